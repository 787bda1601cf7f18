"""Built-in numpy models for the trainer, and the ``Model`` protocol they follow.

A model gives one flat float32 parameter vector (``init``) and, per batch, the loss and its
gradient summed over the rows (``loss_and_grad``); see ``Model``. The built-ins are
vectorised float32 numpy, picklable, stateless, and safe to call from several threads.

- ``LinearRegression(n_features)``: squared error, regression.
- ``LogisticRegression(n_features)``: binary log loss, labels 0/1.
- ``SoftmaxRegression(n_features, n_classes)``: multinomial cross-entropy.
- ``MLP(layers, activation="relu", task="classification")``: dense layers, ReLU or tanh.
- ``TorchModel(module, loss="cross_entropy")``: any ``torch.nn.Module`` (extra ``[torch]``).
"""

from allreduce_param.models.base import Model
from allreduce_param.models.linear import LinearRegression, LogisticRegression, SoftmaxRegression
from allreduce_param.models.mlp import MLP
from allreduce_param.models.torch_module import TorchModel

__all__ = [
    "Model",
    "LinearRegression",
    "LogisticRegression",
    "SoftmaxRegression",
    "MLP",
    "TorchModel",
]
