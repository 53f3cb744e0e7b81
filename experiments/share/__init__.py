"""The update's FLOPs and peak with each group's prompt computed once against once per row
(`python -m experiments.share.main`)."""
