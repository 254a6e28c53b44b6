"""The stages of the pipeline, one module each: a Prefect task declared with `@stage` (tasks/stage.py) and what only
that stage does. Helpers they share live one floor down, in tasks/; none of them imports a stage."""
