"""The built-in grids: ``quick`` (CI, about 1 minute), ``default`` (docs/experiments.md) and
``acceptance`` (the full training-fidelity grids, SGD and Adam); docs/experiments.md gives
their wall times on 2 cores.

Every experiment gives all its methods the same hyperparameters. The networks train at
the settings users train with (SGD, momentum 0.9, lr 0.1, batch 32 per rank, 2 ranks,
no weight decay as in examples/mxnet_gluon_digits.py) and gradfuse's defaults (the
momentum-correction axis at "default"). The Transformer LM trains with AdamW at
torch's defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01), batch 32
windows of 64 bytes per rank, 600 steps; the digits CNN's Adam experiment with MXNet's
Adam at its defaults (lr 1e-3, no weight decay). The counterexample runs the paper's
setting: plain SGD (no momentum), one sampled term per worker and step. ``python -m
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
# Adam and AdamW: torch.optim.AdamW's defaults (lr 1e-3, betas, eps, decoupled decay 0.01);
# MXNet's Adam at its defaults, without weight decay
ADAMW = {"optimizer": "adamw", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "wd": 0.01}
ADAM = {"optimizer": "adam", "lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "wd": 0.0}
# the LM: 6 evaluations of 100 steps = 600 steps of 32 windows of 64 bytes per rank
LM = dict(ADAMW, task="transformer_lm", epochs=6, seeds=[0, 1, 2],
          task_options={"d_model": 128, "heads": 4, "layers": 2, "seq": 64, "steps_per_epoch": 100})
LM_METHODS = [{"compress": "none"}, {"compress": "fp16"}, {"compress": "bf16"}, {"compress": "1bit"},
              {"compress": "2bit"}, {"compress": "topk", "ratio": 0.01}]
DIGITS_ADAM_METHODS = [{"compress": "none"}, {"compress": "1bit"}, {"compress": "2bit"},
                       {"compress": "topk", "ratio": 0.01}]

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
        dict(ADAMW, name="lm", task="transformer_lm", epochs=2, seeds=[0],
             task_options={"d_model": 32, "heads": 2, "layers": 1, "seq": 32, "steps_per_epoch": 5,
                           "val_windows": 64},
             methods=[{"compress": "none"}, {"compress": "1bit"}]),
    ],
}

DEFAULT = {
    "name": "default",
    "description": "The grid behind docs/experiments.md: SGD on every task (8 min on 2 cores), the LM with AdamW.",
    "defaults": dict(NETS, seeds=[0, 1, 2, 3, 4]),
    "experiments": [
        {"name": "digits", "task": "digits_cnn", "epochs": 30, "methods": TABLE1},
        dict(COUNTER, name="counterexample", epochs=20, methods=COUNTER_METHODS),
        {"name": "mlp", "task": "mlp", "epochs": 3,
         "task_options": {"n_samples": 40000, "test_fraction": 0.5},
         "methods": MLP_METHODS},
        {"name": "resnet", "task": "resnet", "epochs": 2, "seeds": [0],
         "task_options": {"n": 3, "n_train": 512, "n_test": 64}, "methods": TABLE1},
        # fp32, the 1-bit quantiser and the sparsifier: 9 of the acceptance grid's LM runs (shared)
        dict(LM, name="lm", methods=[m for m in LM_METHODS if m["compress"] in ("none", "1bit", "topk")]),
    ],
}

ACCEPTANCE = {
    "name": "acceptance",
    "description": "The training-fidelity grid: digits CNN 30 epochs x 5 seeds x table 1's rows, the "
                   "MLP on make_classification (100k samples, 25k test) 10 epochs x 5 seeds (SGD); the "
                   "Transformer LM 600 steps x 3 seeds (AdamW) and the digits CNN 30 epochs x 5 seeds (Adam).",
    "defaults": dict(NETS, seeds=[0, 1, 2, 3, 4]),
    "experiments": [
        {"name": "digits", "task": "digits_cnn", "epochs": 30, "methods": TABLE1},
        {"name": "mlp", "task": "mlp", "epochs": 10,
         "task_options": {"n_samples": 100000, "test_fraction": 0.25},
         "methods": MLP_METHODS},
        dict(COUNTER, name="counterexample", epochs=20, methods=COUNTER_METHODS),
        dict(LM, name="lm", methods=LM_METHODS),
        dict(ADAM, name="digits_adam", task="digits_cnn", epochs=30, seeds=[0, 1, 2, 3, 4],
             methods=DIGITS_ADAM_METHODS),
    ],
}

BUILTIN = {"quick": QUICK, "default": DEFAULT, "acceptance": ACCEPTANCE}
