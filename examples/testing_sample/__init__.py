"""A sample consumer pair for the test kit: an idempotent notifier and a broken one."""
