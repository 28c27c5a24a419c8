"""Put on a child's PYTHONPATH with UGPUM_TEST_SIGNAL_AT="MODULE:SIGNAL": the child sends itself that real
signal the moment Python first looks for MODULE, so a stop lands at a chosen point of the start-up
(inside torch's import of numpy, inside ComfyUI's `try: import ... except:`) instead of at a random one."""
import os
import signal
import sys


class _SignalAtImport:
    def __init__(self, module: str, signum: int):
        self.module, self.signum = module, signum

    def find_spec(self, name, path=None, target=None):
        if name == self.module:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), self.signum)          # handled at the next bytecode: inside this import
        return None


_at = os.environ.get("UGPUM_TEST_SIGNAL_AT", "")
if ":" in _at:
    _module, _signal = _at.split(":", 1)
    sys.meta_path.insert(0, _SignalAtImport(_module, getattr(signal, _signal)))
