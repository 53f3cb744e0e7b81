"""A pretrained model's memory table, L error per unit kind and the manager's set-up cost
(`python -m experiments.real_model.main`)."""
