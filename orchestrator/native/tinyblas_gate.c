/* Keeps ggml-cpu's reference paths off llamafile's tinyBLAS, and lets them compute some matmuls of several rows
with exact_matmuls.c; everything else computes as before.

Why: ggml_compute_forward_mul_mat (ggml-cpu.c) hands every matmul of two or more src1 rows to
`llamafile_sgemm` first (F32, F16, BF16, Q8_0, Q4_0 ... weights or KV), which declines one row ("only enable sgemm
for prompt processing", sgemm.cpp). tinyBLAS and the one-row `vec_dot` kernels sum in other orders, so a
verification of k tokens differs from k one-token steps, whether or not the context computes with
`ggml_backend_cpu_set_use_ref`: that flag gates the tiled matmul and flash attention, not tinyBLAS. This gate
replaces the target of ggml-cpu's own calls to `llamafile_sgemm` (its PLT slot: the library exports and calls the
symbol through the PLT) with `gated_sgemm`. When the compute params say `use_ref` and the matrix is F32, F16 or
BF16, it computes F16 x F16 with exact_matmuls.c's F16 matmul where that agreed with the library's
`ggml_vec_dot_f16`, and otherwise declines (returns false: ggml computes the matmul itself, row by row with
`vec_dot`, as in a build with -DGGML_LLAMAFILE=OFF); it calls the original otherwise. Quantized tinyBLAS (Q8_0,
Q5_0, Q4_0 ...) sums each row's blocks as `vec_dot` does: kept, verifications stay exact (Gemma 3 270M's Q8_0 and
Q5_0 weights: widths 2..16, 20..32 in the default layout, bench/results/2026-12-07/tinyblas-gate) and keep its
speed. ggml-cpu's call to `ggml_compute_forward_mul_mat_tiled`, which declines `use_ref`, goes to `gated_tiled`
the same way: there exact_matmuls.c's Q4_K/Q5_K/Q6_K matmul takes reference-path K-quant matmuls of 2+ rows
where it agreed with the library's kernels, which ggml would otherwise compute row by row. So prefill keeps
tinyBLAS and the tiled kernel, and decode steps and verifications, which the runtime computes with the reference paths
(orchestrator/kernels.py), sum every element as a one-row step sums it.

The layouts read are in ggml_abi.h (llama-cpp-python 0.3.36, the version pyproject.toml pins); the runtime
measures exactness at start anyway, so a layout that had changed would show up as no exact width, not as a wrong
answer.

API (ctypes): int orchestrator_gate_tinyblas(const char *library_name_part): patches the jump slots of
`llamafile_sgemm` and `ggml_compute_forward_mul_mat_tiled` in the first loaded object (load order: llama_cpp's,
loaded at its import) whose path contains library_name_part and that defines them; returns the number of
`llamafile_sgemm` slots that now point at the gate (already-patched ones included), 0 where none was found (a
build without llamafile, or one that calls it directly), -1 where a slot could not be made writable. Only the
first: a second copy of the library (another file name for the same library: pip installs libggml-cpu.so, .so.0
and .so.0.25.3 as copies, not links) has its own tables, which only the copy llama.cpp initialised
(ggml_cpu_init) has filled; calling into it computes garbage, so the gate's originals are the first copy's, and
other copies are left alone. orchestrator_exact_f16 and orchestrator_exact_kquants (at the end) turn
exact_matmuls.c's kernels on; exact_matmuls.c exports orchestrator_exact_abi and orchestrator_exact_use itself.
Thread safety: call these before the first computation that uses reference paths; a slot write is one aligned
pointer store. */
#define _GNU_SOURCE
#include <elf.h>
#include <link.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ggml_abi.h"

typedef bool (*sgemm_fn)(const struct ggml_compute_params_0_3_36 *, int64_t, int64_t, int64_t, const void *,
                         int64_t, const void *, int64_t, void *, int64_t, int, int, int);
typedef bool (*tiled_fn)(const struct ggml_compute_params_0_3_36 *, struct ggml_tensor_0_3_36 *);

static sgemm_fn original_sgemm;
static tiled_fn original_tiled;

static bool gated_sgemm(const struct ggml_compute_params_0_3_36 *params, int64_t m, int64_t n, int64_t k,
                        const void *A, int64_t lda, const void *B, int64_t ldb, void *C, int64_t ldc, int Atype,
                        int Btype, int Ctype) {
    if (params->use_ref && (Atype == GGML_TYPE_F32 || Atype == GGML_TYPE_F16 || Atype == GGML_TYPE_BF16)) {
        /* mul_mat's second call: B converted to F16 as the vec_dot path converts it (exact_matmuls.c) */
        if (Atype == GGML_TYPE_F16 && Btype == GGML_TYPE_F16 && Ctype == GGML_TYPE_F32 && n >= 2 && k > 0
            && k <= INT32_MAX && exact_f16_on()) {
            exact_f16_gemm(params->ith, params->nth, m, n, k, A, lda, B, ldb, C, ldc);
            return true;
        }
        return false;
    }
    return original_sgemm(params, m, n, k, A, lda, B, ldb, C, ldc, Atype, Btype, Ctype);
}

/* ggml_compute_forward_mul_mat asks this first; the tiled kernel declines `use_ref`, where the exact K-quant
matmul (exact_matmuls.c) may take it. */
static bool gated_tiled(const struct ggml_compute_params_0_3_36 *params, struct ggml_tensor_0_3_36 *dst) {
    if (params->use_ref) {
        return exact_kquant_mul_mat(params, dst);
    }
    return original_tiled(params, dst);
}

struct hook {
    const char *symbol;
    void *gate;
    void **original;
};

static const struct hook hooks[] = {
    {"llamafile_sgemm", (void *)gated_sgemm, (void **)&original_sgemm},
    {"ggml_compute_forward_mul_mat_tiled", (void *)gated_tiled, (void **)&original_tiled},
};

#if defined(__x86_64__)
#define JUMP_SLOT R_X86_64_JUMP_SLOT
#define GLOB_DAT R_X86_64_GLOB_DAT
#elif defined(__aarch64__)
#define JUMP_SLOT R_AARCH64_JUMP_SLOT
#define GLOB_DAT R_AARCH64_GLOB_DAT
#else
#define JUMP_SLOT (-1)
#define GLOB_DAT (-1)
#endif

struct search {
    const char *name_part;
    int patched;
};

/* glibc stores the dynamic section's pointers relocated (absolute); others keep them relative to the base. */
static uintptr_t absolute(uintptr_t value, uintptr_t base) { return value < base ? value + base : value; }

static int patch_object(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct search *search = data;
    if (!info->dlpi_name || !strstr(info->dlpi_name, search->name_part)) {
        return 0;
    }
    const ElfW(Dyn) *dynamic = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) {
            dynamic = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
        }
    }
    if (!dynamic) {
        return 0;
    }
    uintptr_t base = info->dlpi_addr, jmprel = 0, rela = 0, symtab = 0, strtab = 0;
    size_t jmprel_size = 0, rela_size = 0;
    for (const ElfW(Dyn) *d = dynamic; d->d_tag != DT_NULL; d++) {
        switch (d->d_tag) {
        case DT_JMPREL: jmprel = absolute(d->d_un.d_ptr, base); break;
        case DT_PLTRELSZ: jmprel_size = d->d_un.d_val; break;
        case DT_RELA: rela = absolute(d->d_un.d_ptr, base); break;
        case DT_RELASZ: rela_size = d->d_un.d_val; break;
        case DT_SYMTAB: symtab = absolute(d->d_un.d_ptr, base); break;
        case DT_STRTAB: strtab = absolute(d->d_un.d_ptr, base); break;
        }
    }
    if (!symtab || !strtab) {
        return 0;
    }
    const ElfW(Sym) *symbols = (const ElfW(Sym) *)symtab;
    const char *strings = (const char *)strtab;
    const uintptr_t tables[2] = {jmprel, rela};
    const size_t sizes[2] = {jmprel_size, rela_size};
    for (int t = 0; t < 2; t++) {
        const ElfW(Rela) *r = (const ElfW(Rela) *)tables[t];
        for (size_t i = 0; r && i < sizes[t] / sizeof(ElfW(Rela)); i++) {
            long type = (long)ELF64_R_TYPE(r[i].r_info);
            if (type != JUMP_SLOT && type != GLOB_DAT) {
                continue;
            }
            const ElfW(Sym) *symbol = &symbols[ELF64_R_SYM(r[i].r_info)];
            const struct hook *hook = NULL;
            for (size_t h = 0; h < sizeof(hooks) / sizeof(hooks[0]); h++) {
                if (strcmp(strings + symbol->st_name, hooks[h].symbol) == 0) {
                    hook = &hooks[h];
                    break;
                }
            }
            if (!hook || symbol->st_shndx == SHN_UNDEF) {
                continue;  /* not one, or a library that calls another's copy: leave it */
            }
            void **slot = (void **)(base + r[i].r_offset);
            void *definition = (void *)(base + symbol->st_value);
            if (*hook->original && *hook->original != definition) {
                continue;  /* another copy of the library (below) */
            }
            if (*slot != hook->gate) {
                /* the definition itself, not the slot: a lazy slot still points at the PLT resolver */
                *hook->original = definition;
                long page = sysconf(_SC_PAGESIZE);
                void *start = (void *)((uintptr_t)slot & ~(uintptr_t)(page - 1));
                if (mprotect(start, (size_t)page, PROT_READ | PROT_WRITE) != 0) {
                    search->patched = -1;
                    return 1;
                }
                __atomic_store_n(slot, hook->gate, __ATOMIC_SEQ_CST);
            }
            if (hook->original == (void **)&original_sgemm) {
                search->patched++;
            }
        }
    }
    return 0;
}

int orchestrator_gate_tinyblas(const char *library_name_part) {
    struct search search = {library_name_part, 0};
    dl_iterate_phdr(patch_object, &search);
    return search.patched;
}

/* Turns on the exact F16 matmul for reference paths where it agrees bit for bit with `dot`, the loaded library's
ggml_vec_dot_f16 (exact_matmuls.c). Returns 1 where it is on, else 0. */
int orchestrator_exact_f16(void *dot) { return original_sgemm ? exact_f16_check((vec_dot_fn)dot) : 0; }

/* Turns on the exact Q4_K/Q6_K/Q5_K matmuls for reference paths where each agrees bit for bit with the library's
kernel (exact_matmuls.c: the arguments are ggml-cpu's ggml_vec_dot_q4_K_q8_K, ggml_vec_dot_q6_K_q8_K,
ggml_vec_dot_q5_K_q8_K, quantize_row_q8_K and ggml_barrier). Returns exact_kquant_check's bit set of the copies
that agreed; 0 where the tiled kernel's slot was not gated or none agrees. */
int orchestrator_exact_kquants(void *dot_q4_K, void *dot_q6_K, void *dot_q5_K, void *quantize_q8_K, void *barrier) {
    if (!original_tiled) {
        return 0;
    }
    return exact_kquant_check((vec_dot_fn)dot_q4_K, (vec_dot_fn)dot_q6_K, (vec_dot_fn)dot_q5_K,
                              (quantize_row_fn)quantize_q8_K, (barrier_fn)barrier);
}
