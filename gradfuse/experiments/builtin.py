"""The built-in grids: ``quick`` (CI, about 1 minute), ``default`` (docs/experiments.md, about
11 minutes on 2 idle cores) and ``acceptance`` (the full training-fidelity grid, about 45).

Every experiment gives all its methods the same hyperparameters. The networks train at
the settings users train with (SGD, momentum 0.9, lr 0.1, batch 32 per rank, 2 ranks,
no weight decay as in examples/mxnet_gluon_digits.py) and gradfuse's defaults (the
momentum-correction axis at "default"). The counterexample runs the paper's setting:
plain SGD (no momentum), one sampled term per worker and step. ``python -m
gradfuse.experiments --print-grid NAME`` writes any of them as TOML to start a config from.
"""

NETS = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "wd": 0.0, "batch_size": 32, "workers": [2],
        "split_seed": 0, "momentum_correction": ["default"]}

# Table 1's rows: none, fp16, bf16, 1bit with and without EF, 2bit / topk / randomk with EF
TABLE1 = [{"compress": "none"}, {"compress": "fp16"}, {"compress": "bf16"},
          {"compress": "1bit", "error_feedback": [True, False]}, {"compress": "2bit"},
          {"compress": "topk", "ratio": 0.01}, {"compress": "randomk", "ratio": 0.01}]
# the MLP's rows
MLP_METHODS = [{"compress": "none"}, {"compress": "fp16"}, {"compress": "bf16"}, {"compress": "1bit"},
               {"compress": "2bit"}]
COUNTER_METHODS = [{"compress": "none"}, {"compress": "1bit", "error_feedback": [True, False]}]
COUNTER = {"task": "counterexample", "lr": 0.1, "momentum": 0.0, "batch_size": 1}

QUICK = {
    "name": "quick",
    "description": "Smoke grid for CI: every task, a few runs each, end to end through mpiexec.",
    "defaults": dict(NETS, seeds=[0, 1]),
    "experiments": [
        {"name": "digits", "task": "digits_cnn", "epochs": 3,
         "methods": [{"compress": "none"}, {"compress": "1bit", "error_feedback": [True, False]}]},
        dict(COUNTER, name="counterexample", epochs=8, seeds=[0], methods=COUNTER_METHODS),
        {"name": "mlp", "task": "mlp", "epochs": 1, "seeds": [0],
         "task_options": {"n_samples": 4000, "test_fraction": 0.5},
         "methods": [{"compress": "none"}, {"compress": "2bit"}]},
        {"name": "resnet", "task": "resnet", "epochs": 1, "seeds": [0],
         "task_options": {"n": 1, "n_train": 128, "n_test": 64},
         "methods": [{"compress": "none"}, {"compress": "1bit"}]},
    ],
}

DEFAULT = {
    "name": "default",
    "description": "The grid behind docs/experiments.md (about 11 minutes on 2 idle cores).",
    "defaults": dict(NETS, seeds=[0, 1, 2, 3, 4]),
    "experiments": [
        {"name": "digits", "task": "digits_cnn", "epochs": 30, "methods": TABLE1},
        dict(COUNTER, name="counterexample", epochs=20, methods=COUNTER_METHODS),
        {"name": "mlp", "task": "mlp", "epochs": 3,
         "task_options": {"n_samples": 40000, "test_fraction": 0.5},
         "methods": MLP_METHODS},
        {"name": "resnet", "task": "resnet", "epochs": 2, "seeds": [0],
         "task_options": {"n": 3, "n_train": 512, "n_test": 64}, "methods": TABLE1},
    ],
}

ACCEPTANCE = {
    "name": "acceptance",
    "description": "The training-fidelity grid: digits CNN 30 epochs x 5 seeds x table 1's rows, and the "
                   "MLP on make_classification (100k samples, 25k test) 10 epochs x 5 seeds.",
    "defaults": dict(NETS, seeds=[0, 1, 2, 3, 4]),
    "experiments": [
        {"name": "digits", "task": "digits_cnn", "epochs": 30, "methods": TABLE1},
        {"name": "mlp", "task": "mlp", "epochs": 10,
         "task_options": {"n_samples": 100000, "test_fraction": 0.25},
         "methods": MLP_METHODS},
        dict(COUNTER, name="counterexample", epochs=20, methods=COUNTER_METHODS),
    ],
}

BUILTIN = {"quick": QUICK, "default": DEFAULT, "acceptance": ACCEPTANCE}
