"""The parallelisms a plan asks for inside a data-parallel replica: pipeline stages and schedules (pipeline*),
tensor parallelism, FSDP2/ZeRO and recompute. Each module does one job; the rank loop plugs them in."""
