"""Answering with a registered model: the pyfunc saved with each version (served_pyfunc.py, run by MLflow), the
predictions the gate and `imagelake predict` compute (predict.py), the CLI's serving (cli_serving.py) and the batch
scorer Spark's executors run (batch_scorer.py)."""
