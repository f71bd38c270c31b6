/* fragless's C ABI: what PyTorch's CUDAPluggableAllocator, the Python helper and any C program load from
 * libfragless.so. Every function is safe to call before fragless_init (it initialises with the device
 * count the driver reports). Configuration comes from FRAGLESS_CONF (PYTORCH_CUDA_ALLOC_CONF grammar).
 *
 * Out of memory: fragless_malloc throws a C++ exception (fragless::OutOfMemoryError, derived from
 * std::runtime_error) whose message starts as PyTorch's does ("CUDA out of memory. Tried to allocate ...")
 * and carries fragless's diagnosis; PyTorch turns it into a Python RuntimeError with that text. It never
 * returns NULL for a non-zero size: PyTorch's normal path would wrap NULL in a tensor that faults later.
 * Any other failure (no driver can start, an invalid device) throws std::runtime_error with the reason. A
 * caller with no C++ handler around the call (C, Python's ctypes) uses fragless_pool_malloc, for
 * torch.cuda.MemPool (whose path retries and raises torch.cuda.OutOfMemoryError on NULL), which returns
 * NULL instead; fragless_last_error() then holds the diagnosis.
 *
 * Errors: no other function lets an exception out (PyTorch calls them from noexcept code): what is thrown
 * inside one (out of host memory, a graph pool's stream filter) is its error. Each function that can fail
 * clears the calling thread's last error when it starts and sets it when it fails, so fragless_last_error()
 * after a call says how that call went; those that return nothing and that PyTorch calls as hooks (free,
 * record_stream, init, the pool hooks) also print the refusal of bad input as one line on stderr. Every
 * function works when called from a thread_local or static destructor or an atexit handler, at any point of a
 * thread's or the process's end. docs/PYTORCH.md, "The C ABI", lists the functions and their results for bad
 * input. */
#ifndef FRAGLESS_FRAGLESS_H_
#define FRAGLESS_FRAGLESS_H_

#include <stddef.h>

#ifdef __cplusplus
#include <functional>
#include <utility>
extern "C" {
#endif

#define FRAGLESS_API __attribute__((visibility("default")))

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t; /* the CUDA runtime's own definition */

/* CUDAPluggableAllocator(path, "fragless_malloc", "fragless_free"). fragless_free frees through the engine
 * that owns ptr, whatever device is named (no engine is made for a device named but never used); NULL frees
 * nothing; a pointer fragless did not allocate (or freed already, or inside an allocation) changes nothing and
 * is named in fragless_last_error and on stderr. */
FRAGLESS_API void* fragless_malloc(size_t size, int device, cudaStream_t stream);
FRAGLESS_API void fragless_free(void* ptr, size_t size, int device, cudaStream_t stream);
/* Out of memory in fragless_malloc calls thrower(message) first, which is expected to throw the host
 * framework's own exception: fragless.torch.enable() builds one against the running PyTorch that throws
 * c10::OutOfMemoryError, which PyTorch raises as torch.cuda.OutOfMemoryError. NULL restores the default. */
FRAGLESS_API void fragless_set_oom_thrower(void (*thrower)(const char* message));
/* Without a thrower, the out-of-memory exception's message ends with `note` (NULL or "": nothing): why the
 * error is not the framework's own (fragless.torch.enable() says where no thrower could be had). */
FRAGLESS_API void fragless_set_oom_note(const char* note);
/* Adds a function fragless_malloc calls when a request runs out of memory, before it throws, with no lock of
 * fragless held, as PyTorch calls the observers of torch._C._cuda_attach_out_of_memory_observer: the device, the
 * bytes asked for, the memory fraction's limit in bytes (the device's total without one) and the device's free
 * bytes. At most 64 for the process, never removed; returns 0, or -1 with fragless_last_error saying why (a
 * null function, or 64 already added). */
FRAGLESS_API int fragless_attach_oom_observer(void (*observer)(int device, size_t alloc, size_t limit, size_t device_free));
/* Checks a FRAGLESS_CONF string without creating anything: 0 when it is valid, else the length of the error
 * message (naming the key, the value and the accepted forms), written into buf as fragless_memory_stats
 * writes its text; -1 when it could not be checked (out of host memory: fragless_last_error says so). */
FRAGLESS_API long fragless_check_config(const char* conf, char* buf, size_t len);
/* The same, and then whether the configuration's driver can start here (the cuda driver needs libcuda and a
 * device), creating nothing: 0, or the length of the message saying why not. */
FRAGLESS_API long fragless_check_driver(const char* conf, char* buf, size_t len);
/* The FRAGLESS_CONF string the process's allocator was made with (its length, the text written into buf as
 * fragless_memory_stats writes its text); -1 while no call has made the allocator yet; -2 when an earlier call
 * failed to make it (for good: fragless_last_error says why). Makes nothing. A configuration given after the
 * allocator was made cannot apply: fragless.torch.enable() checks it here. */
FRAGLESS_API long fragless_settings(char* buf, size_t len);
/* 1 when two FRAGLESS_CONF strings select the same settings (the same value of every key, however spelled,
 * a key at its default given or not), 0 when they differ, -1 when either is not valid (fragless_last_error
 * says which, and why). */
FRAGLESS_API int fragless_same_config(const char* a, const char* b);
/* The same allocation, NULL on failure (torch.cuda.MemPool's allocator: PyTorch retries and raises). */
FRAGLESS_API void* fragless_pool_malloc(size_t size, int device, cudaStream_t stream);

/* Optional hooks, with the signatures PyTorch's setters expect. fragless_init makes the allocator for
 * device_count devices (0 or less: as many as the driver reports), unless a call made it already; a count
 * above 128 is refused, named in fragless_last_error and on stderr, and makes nothing (a count within 128
 * but above the driver's devices is taken: the devices past the driver's fail at their first use). */
FRAGLESS_API void fragless_init(int device_count);                         /* set_init_fn */
FRAGLESS_API void fragless_empty_cache(void);                              /* set_reset_fn */
FRAGLESS_API void fragless_set_memory_fraction(double fraction, int device); /* set_memory_fraction_fn */
/* The device's memory fraction (torch.cuda.get_per_process_memory_fraction): the last one set, else the
 * configuration's per_process_memory_fraction; -1 for an invalid device (see fragless_last_error). */
FRAGLESS_API double fragless_get_memory_fraction(int device);
FRAGLESS_API void* fragless_get_base_allocation(void* ptr, size_t* size);  /* set_base_alloc_fn */
/* set_record_stream_fn: the allocation at ptr is also used on `stream`. A pointer fragless did not allocate
 * (or freed, or inside an allocation) changes nothing and is named in fragless_last_error and on stderr; NULL
 * (what a 0-byte allocation returns) and a block fragless_open_shared mapped are nothing to record. */
FRAGLESS_API void fragless_record_stream(void* ptr, cudaStream_t stream);
typedef struct { unsigned long long first, second; } fragless_pool_id; /* MempoolId_t's layout */
#ifdef __cplusplus
/* set_begin_allocate_to_pool: PyTorch passes a C++ std::function by value (a C++ ABI dependency). An empty
 * filter takes every stream. A filter that throws fails the allocation that called it: fragless_pool_malloc
 * returns NULL with the filter's message in fragless_last_error, fragless_malloc throws it. */
FRAGLESS_API void fragless_begin_allocate_to_pool(int device, fragless_pool_id pool, std::function<bool(cudaStream_t)> filter);
#endif
/* set_end_allocate_to_pool_fn: ends the pool's newest routing. A pool with none (never begun, or ended
 * already) changes nothing and is named in fragless_last_error and on stderr. */
FRAGLESS_API void fragless_end_allocate_to_pool(int device, fragless_pool_id pool);
/* PyTorch 2.1 and 2.2's form of the two above, which route by stream (2.3 replaced them):
 * set_begin_allocate_stream_to_pool: allocations on exactly `stream` come from `pool` (a capture on that
 * stream), a use of the pool counted as fragless_begin_allocate_to_pool counts one. */
FRAGLESS_API void fragless_begin_allocate_stream_to_pool(int device, cudaStream_t stream, fragless_pool_id pool);
/* set_end_allocate_stream_to_pool_fn: ends the routing begun for `stream` (the newest, when it was begun
 * twice), whatever its pool: two graphs sharing a pool may be captured at once on two streams. A stream with
 * no routing changes nothing and is named in fragless_last_error and on stderr. */
FRAGLESS_API void fragless_end_allocate_stream_to_pool(int device, cudaStream_t stream);
/* set_release_pool: ends a use of the pool (each begin counts one); its memory goes when none is left. A pool
 * with no use left (never begun, or released as often as begun) changes nothing and is named in
 * fragless_last_error and on stderr; a synchronisation that failed is in fragless_last_error. */
FRAGLESS_API void fragless_release_pool(int device, fragless_pool_id pool);

/* Statistics with torch.cuda.memory_stats() key names (and fragless's own: fragless.*, and sharing's
 * exported_bytes.* and imported_bytes.* in PyTorch's key style), as one JSON object, written into buf
 * (NUL-terminated when len > 0). Returns the length of the full text (call again with a larger buffer when
 * it is >= len), or -1 for an invalid device (see fragless_last_error). */
FRAGLESS_API long fragless_memory_stats(int device, char* buf, size_t len);
FRAGLESS_API int fragless_reset_peak_stats(int device);
FRAGLESS_API int fragless_reset_accumulated_stats(int device);
/* The device's free and total memory as the driver reports them (torch.cuda.mem_get_info); -1 for an invalid
 * device or a NULL out-parameter (fragless_last_error names it). */
FRAGLESS_API int fragless_mem_get_info(int device, size_t* free_bytes, size_t* total_bytes);
/* A snapshot in PyTorch's layout (the pickle torch.cuda.memory._dump_snapshot writes): segments of every
 * device and, when history is on, recent events as device_traces; blocks held for other processes carry
 * fragless's extra keys and other processes' memory mapped here is listed as "imported" (docs/PYTORCH.md,
 * "Sharing across processes"). Same buffer protocol; -1 on error. A call without a buffer keeps the snapshot it built
 * for the calling thread's next call: one with a buffer of exactly the returned length + 1 gets that snapshot
 * (the state when it was sized); any other call builds anew. */
FRAGLESS_API long fragless_snapshot(char* buf, size_t len);
/* The same snapshot without its trace entries (device_traces empty lists; the blocks' and segments' frames
 * kept): what torch.cuda.memory_snapshot() and memory_summary() need, at the cost of the segments alone. */
FRAGLESS_API long fragless_snapshot_segments(char* buf, size_t len);
/* Keep the last max_entries events per device for snapshots (max_entries 0 turns it off). */
FRAGLESS_API void fragless_record_history(size_t max_entries);
/* The same, with stack frames (torch.cuda.memory._record_memory_history's context and stacks): context 0 no
 * frames, 1 frames of each allocation, 2 of each free too; stacks 1 Python (the calling thread's frames, the GIL
 * taken for the walk if the thread released it; none for a thread without a Python thread state), 2 C++, 3 both. Frames are captured as addresses and code objects and symbolised when a snapshot is taken.
 * Another context or stacks value changes nothing and sets fragless_last_error. */
FRAGLESS_API void fragless_record_history_ex(size_t max_entries, int context, int stacks);
/* The same with torch.cuda.memory._record_memory_history's meanings: context is PyTorch's RecordContext, 0 no
 * frames, 1 frames of live blocks' allocations only ("state": none on history entries), 2 of allocations on
 * history entries too ("alloc"), 3 of frees too ("all"); stacks as above; clear_history non-zero drops the
 * events kept so far (turning history off, max_entries 0, always does). Another context or stacks value changes
 * nothing and sets fragless_last_error. */
FRAGLESS_API void fragless_record_history_v2(size_t max_entries, int context, int stacks, int clear_history);
/* The last error of this thread: "" when its last call that can fail did not. Valid until the thread's next
 * call; at most 4095 bytes (a longer message is cut at a character's boundary and ends with "..."). */
FRAGLESS_API const char* fragless_last_error(void);
/* Writes buffered trace records (the tracer also flushes at exit). */
FRAGLESS_API void fragless_trace_flush(void);
/* Devices fragless manages (initialising if needed); -1 if it cannot start (see fragless_last_error). */
FRAGLESS_API int fragless_device_count(void);

/* Sharing across processes (docs/PYTORCH.md, "Sharing across processes"). The allocation that starts at ptr, exported:
 * NULL with fragless_last_error() when it cannot be (not a live allocation; memory not created exportable:
 * shareable_handles:True). The allocation stays held, whatever its owner frees, while any copy of the
 * share's lease is open in any process. */
typedef struct fragless_share fragless_share;
FRAGLESS_API fragless_share* fragless_share_export(void* ptr);
/* The share's description (*bytes, the return value its length) and its descriptors (*fds, the return value
 * their count: the lease first, then one per physical handle; the lease alone with
 * shareable_handles:fabric, whose handles are in the description), owned by the share. Send both; descriptors
 * as descriptors (SCM_RIGHTS). */
FRAGLESS_API size_t fragless_share_description(const fragless_share* share, const char** bytes);
FRAGLESS_API size_t fragless_share_fds(const fragless_share* share, const int** fds);
/* Closes this process's copies of the share's descriptors and frees it (copies sent elsewhere stay open). */
FRAGLESS_API void fragless_share_free(fragless_share* share);
/* Maps a share received from another process (or this one) on `device`: the pointer to the allocation and
 * *size; NULL with fragless_last_error() when the description or descriptors are refused (forged, stale,
 * malformed) or mapping fails; nothing is mapped then. The descriptors stay the caller's. */
FRAGLESS_API void* fragless_open_shared(int device, const char* bytes, size_t len, const int* fds, size_t nfds,
                                        size_t* size);
/* Unmaps what fragless_open_shared mapped and drops its reference; 0, or -1 with fragless_last_error(). */
FRAGLESS_API int fragless_close_shared(void* ptr);
/* Frees the allocations whose owner freed them and whose every lease is closed now (slow allocations,
 * empty_cache and statistics do it too); returns how many. */
FRAGLESS_API size_t fragless_reap_shared(void);
/* NCCL user-buffer registration: call fragless_register_range(buf, size) right after ncclCommRegister(comm,
 * buf, size, &handle) and fragless_deregister_range(buf) right after ncclCommDeregister. Until then the
 * allocation holding [buf, buf+size) is never re-backed (its free waits). 0, or -1 with fragless_last_error()
 * when the range is not inside one live fragless allocation. */
FRAGLESS_API int fragless_register_range(void* ptr, size_t size);
FRAGLESS_API int fragless_deregister_range(void* ptr);

#ifdef __cplusplus
}
#endif
#endif
