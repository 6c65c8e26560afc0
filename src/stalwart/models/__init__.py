"""Reference models for fault-injection campaigns, trained in seconds on CPU.

    from stalwart import models
    ref = models.load("digits-cnn")       # ReferenceModel: model, inputs, labels, criteria

``digits-cnn`` and ``mlp`` (scikit-learn digits), ``dlrm`` (synthetic click-through data),
``gcn`` (a stochastic block-model graph), ``transformer`` (a synthetic sequence task).
Each module is also a template for wrapping your own model.
"""

from stalwart.models.base import ReferenceModel, available, cache_folder, load, model_hash

__all__ = ["ReferenceModel", "available", "cache_folder", "load", "model_hash"]
