"""The process-wide runtime: one context (communication thread and control plane) per
communicator, the agreement protocol, the watchdog, async matching by name and the
timeline."""
