"""The hardware layer: detect the machine, check it against a profile from conf/hw/, adapt when asked."""
from hybrid.hw.check import HardwareMismatch, check, resolve
from hybrid.hw.detect import Gpu, Machine, detect

__all__ = ["Gpu", "HardwareMismatch", "Machine", "check", "detect", "resolve"]
