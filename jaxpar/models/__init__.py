"""Reference models: an MLP and a decoder-only GPT (dense and 3D-parallel forms).

``mlp`` (the MLP and its ``TENSOR_RULES``), ``gpt`` (the model, its
``TENSOR_RULES``, pipeline split and tensor-parallel functions),
``sampling`` (generation from a trained GPT), ``flops`` (FLOPs per token,
peak device FLOP/s).
"""

from jaxpar.models import flops as flops
from jaxpar.models import gpt as gpt
from jaxpar.models import mlp as mlp
from jaxpar.models import sampling as sampling
from jaxpar.models.gpt import GPT as GPT
from jaxpar.models.gpt import GPTConfig as GPTConfig
from jaxpar.models.mlp import MLP as MLP

__all__ = ['GPT', 'GPTConfig', 'MLP', 'flops', 'gpt', 'mlp', 'sampling']
