"""native.flash with the parameters attnkern.tune finds against its built-in
defaults, for the suite's shapes (commits before the tuner are skipped). The
search runs once per benchmark run, in setup_cache, with a small budget."""

import attnkern

from .common import THREADS, axis, parse_shape, random_qkv, setup_kernel

SHAPES = axis(["1x8x1024x64", "1x8x2048x64"])


class Tuned:
    params = [["default", "tuned"], SHAPES, [False, True]]
    param_names = ["params", "shape", "causal"]
    rounds = 2
    repeat = (3, 10, 2.0)
    timeout = 600

    def setup_cache(self):
        if not hasattr(attnkern, "tune"):
            return None
        found = {}
        for shape in SHAPES:
            for causal in (False, True):
                result = attnkern.tune(parse_shape(shape), causal=causal, budget=8, repeats=3, cache=False)
                found[f"{shape}/{causal}"] = result.params
        return found

    def setup(self, found, which, shape, causal):
        if found is None:
            raise NotImplementedError("attnkern.tune does not exist in this commit")
        params = found[f"{shape}/{causal}"] if which == "tuned" else {}
        self.call = setup_kernel("native.flash", params.get("num_threads", THREADS),
                                 **{k: v for k, v in params.items() if k != "num_threads"})
        self.q, self.k, self.v = random_qkv(shape)

    def time_forward(self, found, which, shape, causal):
        self.call(self.q, self.k, self.v, causal)
