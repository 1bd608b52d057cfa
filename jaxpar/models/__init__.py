"""Reference models: an MLP and a decoder-only GPT (dense and 3D-parallel forms)."""

from jaxpar.models import gpt as gpt
from jaxpar.models.gpt import GPT as GPT
from jaxpar.models.gpt import GPTConfig as GPTConfig
from jaxpar.models.mlp import MLP as MLP
