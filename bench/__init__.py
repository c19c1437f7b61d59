"""mqdedup benchmarks: ``python -m bench`` runs the whole suite (see ``bench/__main__.py``).

The stand-alone scripts (``dedup_bench.py``, ``kafka_bench.py``, ``rabbitmq_bench.py``,
``relay_bench.py``, ``tools_bench.py``) still run on their own; the suite modules
(``suite_*.py``) import their measurements.
"""
