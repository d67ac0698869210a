"""Where the prefill wall goes: scopes in the forward path, a device-synced phase profile with
exclusive attribution, a host wall-clock profile with a Chrome/Perfetto trace, and the seed's
attribution and collective-pricing tables (section 5.2 / 5.3).

The layers import only `scope` from `pocketllm.profiling.scopes`, which imports nothing else, so
the forward path does not depend on the rest of this package."""
