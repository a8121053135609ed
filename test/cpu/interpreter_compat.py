"""What upstream SGLang's Triton kernels need to run under this Triton's CPU interpreter (TRITON_INTERPRET=1)."""
import numpy as np
import triton.runtime.interpreter as interp


def allow_scalar_index(mp) -> None:
    """Let the interpreter's scalars be used as Python ints (`range(0, K, BLOCK_K)` in upstream's GEMMs): numpy
    >= 2.3 refuses int() of the 1-element array the interpreter holds. `mp`: a pytest MonkeyPatch."""
    original_patch = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    mp.setattr(interp, "_patch_lang_tensor", patch_lang_tensor)
