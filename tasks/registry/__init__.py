"""The models' side: MLflow's registry (models.py: loading, aliases, the gate, lineage), the model cards and the plain
baseline every run is held against."""
