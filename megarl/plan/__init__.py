"""The driver side's view of a config before anything starts: the gate (`gate.validate`), the facts a config
implies (`facts`: devices per pool, batch algebra, which roles run), and the plan of `megarl-plan` (parameter
counts, memory per device, the CP a long trajectory needs, padding, sync time; with LoRA `adapters` and `lora`)."""
