"""What the device offers the step: CUDA streams and events with their no-op CPU stand-ins (``streams``), and the
log of issued operations the schedule tests read (``event_log``), the busy time of a timed step's work on a side stream
(``busy_events``).

May import: the standard library and torch; nothing else of megatrain."""
