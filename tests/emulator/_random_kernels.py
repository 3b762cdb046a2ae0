"""Random kernels for tests that the emulator's ways of running a threadgroup agree: each
output depends on every barrier, SIMD-group function and variable being where it should."""
from __future__ import annotations

import random
from typing import List


def random_kernel(name: str, rng: random.Random) -> str:
    """A kernel of nested uniform loops and ifs around barriers; threads exchange values
    through threadgroup memory between barriers, so any misplaced barrier or lost variable
    shows in the output."""
    counter = [0]

    def fresh() -> str:
        counter[0] += 1
        return f"v{counter[0]}"

    def block(depth: int, live: List[str]) -> List[str]:
        lines = []
        for _ in range(rng.randint(1, 3)):
            choice = rng.random()
            if choice < 0.35 or depth >= 3:
                var = fresh()
                src = rng.choice(live)
                lines.append(f"float {var} = {src} * 0.5f + float(lid % {rng.randint(2, 7)});")
                lines.append(f"t[lid] = {var};")
                lines.append("threadgroup_barrier(mem_flags::mem_threadgroup);")
                lines.append(f"{rng.choice(live)} += t[(lid + {rng.randint(1, 40)}) % n];")
                lines.append("threadgroup_barrier(mem_flags::mem_threadgroup);")
                live = live + [var]
            elif choice < 0.6:
                i = fresh()
                lines.append(f"for (uint {i} = 0; {i} < {rng.randint(0, 3)}u; ++{i}) {{")
                lines += block(depth + 1, live)
                if rng.random() < 0.3:
                    lines.append(f"if ({i} == 1u) continue;")
                    lines += block(depth + 1, live)
                lines.append("}")
            elif choice < 0.8:
                lines.append(f"if (mode % {rng.randint(2, 4)}u == 0u) {{")
                lines += block(depth + 1, live)
                lines.append("} else {")
                lines += block(depth + 1, live)
                lines.append("}")
            else:
                i = fresh()
                lines.append(f"uint {i} = 0;")
                lines.append("do {")
                lines += block(depth + 1, live)
                lines.append(f"}} while (++{i} < {rng.randint(1, 3)}u);")
        return lines

    return random_kernel_text(name, block(0, ["acc"]))


def random_kernel_text(name: str, body: List[str]) -> str:
    return (f"kernel void {name}(device float* out [[buffer(0)]], constant uint& mode [[buffer(1)]],\n"
            f"    uint lid [[thread_position_in_threadgroup]], uint gid [[thread_position_in_grid]],\n"
            f"    uint n [[threads_per_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {{\n"
            f"  threadgroup float t[96];\n  float acc = float(gid) * 0.125f;\n  " + "\n  ".join(body) +
            "\n  out[gid] = acc;\n}\n")


def random_simd_kernel(name: str, rng: random.Random) -> str:
    """SIMD-group functions in loops and branches that part the lanes (conditions and trip
    counts of their own, a lane's own `continue` and `break`, and in kernels without
    barriers its `return`) and that do not, with barriers and threadgroup memory where every
    thread goes alike, so lanes meet at different calls and iterations. A shuffle's poison
    (an inactive lane's value) becomes a number, so it is not lost in NaNs."""
    counter = [0]
    barriers = rng.random() < 0.5

    def fresh() -> str:
        counter[0] += 1
        return f"v{counter[0]}"

    reductions = ["simd_sum({})", "simd_max({})", "simd_prefix_inclusive_sum({})", "simd_prefix_exclusive_sum({})",
                  "quad_sum({})", "simd_broadcast_first({})"]
    shuffles = ["simd_shuffle({}, ushort((lane + {k}) % 32))", "simd_shuffle_xor({}, ushort({k}))",
                "simd_shuffle_rotate_down({}, ushort({k}))", "simd_broadcast({}, ushort({k}))"]

    def collective(live: List[str]) -> List[str]:
        call = rng.choice(reductions + shuffles).format(rng.choice(live), k=rng.randint(1, 31))
        target = rng.choice(live)
        return [f"{{ const float s = {call}; {target} = {target} * 0.5f + (s == s ? s : 3.0f); }}"]

    def block(depth: int, live: List[str], uniform: bool) -> List[str]:
        lines = []
        for _ in range(rng.randint(1, 3)):
            choice = rng.random()
            if choice < 0.3 or depth >= 3:
                var = fresh()
                lines.append(f"float {var} = {rng.choice(live)} * 0.75f + float(lid % {rng.randint(2, 7)});")
                live = live + [var]
                lines += collective(live)
            elif choice < 0.45 and uniform and barriers:
                lines.append(f"t[lid] = {rng.choice(live)};")
                lines.append("threadgroup_barrier(mem_flags::mem_threadgroup);")
                lines.append(f"{rng.choice(live)} += t[(lid + {rng.randint(1, 40)}) % n];")
                lines.append("threadgroup_barrier(mem_flags::mem_threadgroup);")
            elif choice < 0.65:
                i = fresh()
                jump = rng.random() < 0.4  # (a lane's own jump parts the loop's iterations too)
                parting = jump or rng.random() < 0.5
                bound = f"(lane % {rng.randint(2, 5)}u) + {rng.randint(0, 2)}u" if parting else f"{rng.randint(0, 3)}u"
                lines.append(f"for (uint {i} = 0; {i} < {bound}; ++{i}) {{")
                lines += block(depth + 1, live, uniform and not parting)
                if jump:
                    lines.append(f"if ({i} == 1u && lane % {rng.randint(2, 4)}u == 0u) "
                                 f"{rng.choice(['continue', 'break'])};")
                    lines += block(depth + 1, live, False)
                lines.append("}")
            elif choice < 0.85:
                parting = rng.random() < 0.6
                condition = f"(lid + {rng.randint(0, 5)}u) % {rng.randint(2, 4)}u == 0u" if parting else \
                    f"mode % {rng.randint(2, 4)}u == 0u"
                lines.append(f"if ({condition}) {{")
                lines += block(depth + 1, live, uniform and not parting)
                lines.append("} else {")
                lines += block(depth + 1, live, uniform and not parting)
                lines.append("}")
            elif not barriers:
                lines.append(f"if (lane == {rng.randint(0, 40)}u) {{ out[gid] = {rng.choice(live)}; return; }}")
            else:
                lines += collective(live)
        return lines

    return random_kernel_text(name, block(0, ["acc"], True) + collective(["acc"]))
