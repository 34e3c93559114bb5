"""LoRA adapters over a loaded model: read (`adapter.py`: PEFT folders), held resident in
slots and chosen per sequence (`adapters.py`); the product itself is
`qinfer.linear.lora.LoraLinear`."""

from qinfer.lora.adapter import LoraAdapter, read_adapter
from qinfer.lora.adapters import Adapters

__all__ = ["Adapters", "LoraAdapter", "read_adapter"]
