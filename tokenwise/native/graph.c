/* Replay of a recorded CPU graph (tokenwise/compilation/cpu_graph.py): call every recorded
 * kernel, in order, through its `_packed` entry (common.h: one int64 array of arguments). The loop
 * is the whole point: what a decode step costs in Python between the kernels (module calls,
 * checks, allocations, ctypes conversions) is not paid again.
 *
 * entries[i]: the address of call i's packed entry; its arguments start at args + offsets[i].
 * Returns 0, or i + 1 for the first call whose kernel returned a nonzero status (in *status);
 * the calls after it are not made.
 */
#include "common.h"

int64_t tw_graph_replay(int64_t n, const int64_t *entries, const int64_t *offsets,
                        const int64_t *args, int *status) {
    for (int64_t i = 0; i < n; ++i) {
        const int st = ((tw_packed_fn)(intptr_t)entries[i])(args + offsets[i]);
        if (st != 0) {
            *status = st;
            return i + 1;
        }
    }
    return 0;
}
