"""The console's one stylesheet (served from ``/static/console.css``: the CSP allows
styles from the console itself only, never inline)."""

from __future__ import annotations

STYLESHEET = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #1f2937; background: #f9fafb; }
header { display: flex; gap: 2em; align-items: center; padding: .6em 1.2em;
         background: #111827; color: #f9fafb; }
header nav a { color: #d1d5db; margin-right: 1.2em; text-decoration: none; }
header nav a.current { color: #fff; border-bottom: 2px solid #60a5fa; }
main { padding: .5em 1.2em 2em; max-width: 1200px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: .4em 0 1em; background: #fff; }
th, td { border: 1px solid #e5e7eb; padding: .3em .6em; text-align: left; vertical-align: top; }
th { background: #f3f4f6; }
pre.body { background: #fff; border: 1px solid #e5e7eb; padding: .6em; white-space: pre-wrap;
           word-break: break-all; max-height: 40em; overflow: auto; }
.truncated, .note { color: #92400e; background: #fef3c7; padding: .3em .6em;
                    display: inline-block; }
.banner { background: #e0f2fe; color: #075985; margin: 0; padding: .4em 1.2em; }
.result { background: #dcfce7; padding: .5em .8em; border: 1px solid #86efac; }
.error { background: #fee2e2; padding: .5em .8em; border: 1px solid #fca5a5; }
.confirm { background: #fff; border: 1px solid #d1d5db; padding: .8em 1em; max-width: 60em; }
.empty { color: #6b7280; }
form { display: inline-block; margin: .2em .4em .2em 0; }
button { cursor: pointer; padding: .3em .9em; border-radius: 4px; border: 1px solid #9ca3af; }
button.primary { background: #2563eb; color: #fff; border-color: #1d4ed8; }
button.danger { background: #dc2626; color: #fff; border-color: #b91c1c; }
a.button { padding: .25em .7em; border: 1px solid #9ca3af; border-radius: 4px;
           text-decoration: none; background: #fff; margin-right: .3em; }
figure.chart { margin: .5em 0 1.5em; background: #fff; border: 1px solid #e5e7eb;
               padding: .5em; display: inline-block; }
.c0 { color: #2563eb; } .c1 { color: #d97706; } .c2 { color: #16a34a; } .c3 { color: #dc2626; }
input[type=text], input[type=password] { padding: .3em; min-width: 20em; }
"""
