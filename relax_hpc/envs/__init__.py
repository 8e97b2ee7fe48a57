"""Multi-turn environments for agentic RL: the protocol (:mod:`.api`), tools and their parsers, a subprocess sandbox,
exact token bookkeeping across turns (:mod:`.tokens`) and the episode runner (:mod:`.episode`)."""
