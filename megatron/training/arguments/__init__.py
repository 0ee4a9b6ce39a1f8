"""The command line: Megatron-LM's flags, one module per flag group, each building its config dataclass.

`parser.py` composes the groups and validates the whole (`parse_run_config`); `megatron_flags.py` holds
Megatron-LM's flags that are no-ops or refused here; `errors.py` turns expected errors into one line.
"""
