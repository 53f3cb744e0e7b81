"""The benchmark wing: every memory method's actor update on one model and budget rule (`run`), its report,
synthetic GRPO minibatches, and paired training quality."""
