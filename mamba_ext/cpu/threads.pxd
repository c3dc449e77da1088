# Thread teams, aligned scratch and the per-thread workspace: the declarations of
# csrc/mx_threads.h (what each does: the header's opening comment), one place for every
# module that cimports them.
cdef extern from "csrc/mx_threads.h" nogil:
    int mx_threads(int n) noexcept               # n > 0: n; else OpenMP's default (1 without OpenMP)
    int mx_team(int n, long long work, long long min_work, long long parts) noexcept
    void* mx_aligned_alloc(size_t nbytes) noexcept    # 64-byte aligned, or NULL
    void mx_aligned_free(void* p) noexcept
    void* mx_workspace(size_t nbytes) noexcept   # this thread's reused scratch, or NULL
