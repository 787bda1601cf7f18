"""Integrations with the tools users track and watch fits in, each an optional extra:
``allreduce_param.integrations.mlflow`` (``pip install 'allreduce-param[mlflow]'``).
Importing ``allreduce_param`` imports none of them."""
