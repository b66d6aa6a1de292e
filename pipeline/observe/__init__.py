"""Observability above the stages: the live view and ``sluice status`` (``live``), the PNG plots (``plots``) and the
end-of-run tables (``report``), all read from a run's folder and queue. The metrics sinks every process writes with
sit below the stages, in ``pipeline.metrics``."""
