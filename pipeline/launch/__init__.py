"""The launcher room: ``sluice run`` as Ray's driver (``launcher``), its stop request and run lock (``control``), the
supervision of every process with restart budgets (``supervisor``), one Ray actor per process (``cluster``), the run's
Ray instance (``ray_runtime``), the reaper that lets nothing outlive its host (``reaper``), and the processes' own
entry points (``processes``). It sits above the stages: it starts them and imports their entry points lazily."""
