// fakecuda.c is a stand-in libcuda.so.1 for machines without a GPU, built
// and used by scripts/cuda-check to run the cuda-tagged tests. It checks the
// Go side, not CUDA: "device" memory is shared memory (so IPC handles work
// between processes), copies are memcpy, and an event completes on its third
// query so the polling path runs. It is strict where the backend could go
// wrong unnoticed:
//   - every call except init, device and primary-context ones fails with
//     CUDA_ERROR_INVALID_CONTEXT on a thread with no current context, which
//     catches a CUDA call made off the worker's or a waiter's locked thread;
//   - copies outside an allocation fail with CUDA_ERROR_INVALID_VALUE, and
//     async copies also need pinned (cuMemHostAlloc) host memory;
//   - opening an IPC handle of the same process fails with
//     CUDA_ERROR_INVALID_CONTEXT, as the real driver does.
// FAKECUDA_FAIL=name=code makes the named call return code (fault injection);
// FAKECUDA_FAIL_NTH=name:N=code only its Nth call, counted from the first
// call of any name to see that value. cuCtxSetCurrent counts only calls with a
// context: a backend's worker makes the 1st, then its waiters, stream by stream.
// FAKECUDA_DELAY_US=N makes streams slow: a stream's work ends in order, each
// event N µs after the later of its record and the stream's previous end;
// until then cuEventQuery answers CUDA_ERROR_NOT_READY, and
// cuEventSynchronize, cuStreamSynchronize and cuCtxSynchronize sleep. Bytes
// still land at enqueue. 0, the default, ends an event when it is recorded
// (it still completes on its third query).
// Only the entry points gorgonia.org/cu and the backend call at run time are
// here; the binary links against the real library and binds lazily.
#define _GNU_SOURCE
#include <cuda.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static __thread CUcontext current;
static struct { int refs; } primary;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

enum kind { DEVICE, IMPORTED, PINNED };

struct alloc {
	uintptr_t base;
	size_t size;
	enum kind kind;
	char name[40];
	struct alloc *next;
};
static struct alloc *allocs; // guarded by mu
static unsigned long seq;     // guarded by mu

struct fake_handle { // fits CU_IPC_HANDLE_SIZE
	char magic[8];
	int32_t pid;
	uint64_t size;
	char name[40];
};

// Times are CLOCK_MONOTONIC nanoseconds. Streams and events are touched by
// the worker's thread and the waiters' threads: their fields are atomic.
struct stream { _Atomic long long end; }; // when its last recorded event ends
struct event {
	_Atomic int pending;   // queries still answered NOT_READY once it ended
	_Atomic long long end; // when the work before it ends
};
static struct stream legacy;      // the default streams
static _Atomic long long ctx_end; // when the last work of any stream ends

static long long now(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void sleep_until(long long end) {
	struct timespec t = {.tv_sec = end / 1000000000LL, .tv_nsec = end % 1000000000LL};
	while (now() < end && clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) == EINTR) {
	}
}

static long long delay(void) {
	const char *d = getenv("FAKECUDA_DELAY_US");
	long long us = d != NULL ? atoll(d) : 0;
	return us > 0 ? us * 1000 : 0;
}

static pthread_mutex_t nth_mu = PTHREAD_MUTEX_INITIALIZER;
static char nth_seen[128];    // FAKECUDA_FAIL_NTH as last seen; guarded by nth_mu
static long nth_calls;        // calls counted since it took that value; guarded by nth_mu
static _Atomic int nth_armed; // nth_seen is not empty

// injected returns the error FAKECUDA_FAIL or FAKECUDA_FAIL_NTH asks of
// call; counts says whether this call counts for FAKECUDA_FAIL_NTH.
static CUresult injected(const char *call, int counts) {
	const char *f = getenv("FAKECUDA_FAIL");
	size_t n = strlen(call);
	if (f != NULL && strncmp(f, call, n) == 0 && f[n] == '=') {
		return (CUresult)atoi(f + n + 1);
	}
	f = getenv("FAKECUDA_FAIL_NTH");
	if (f == NULL && !atomic_load(&nth_armed)) return CUDA_SUCCESS;
	CUresult r = CUDA_SUCCESS;
	pthread_mutex_lock(&nth_mu);
	if (f == NULL) f = "";
	if (strcmp(f, nth_seen) != 0) {
		snprintf(nth_seen, sizeof nth_seen, "%s", f);
		nth_calls = 0;
		atomic_store(&nth_armed, f[0] != 0);
	}
	char *end;
	if (counts && strncmp(f, call, n) == 0 && f[n] == ':') {
		long nth = strtol(f + n + 1, &end, 10);
		if (*end == '=' && ++nth_calls == nth) r = (CUresult)atoi(end + 1);
	}
	pthread_mutex_unlock(&nth_mu);
	return r;
}

#define ENTER_COUNTING(call, counts)                  \
	do {                                          \
		CUresult r_ = injected(call, counts); \
		if (r_ != CUDA_SUCCESS) return r_;    \
	} while (0)
#define ENTER(call) ENTER_COUNTING(call, 1)
#define NEED_CTX(call)                                          \
	do {                                                    \
		ENTER(call);                                    \
		if (current == NULL) return CUDA_ERROR_INVALID_CONTEXT; \
	} while (0)

static void add(uintptr_t base, size_t size, enum kind kind, const char *name) {
	struct alloc *a = calloc(1, sizeof *a);
	if (a == NULL) abort();
	a->base = base;
	a->size = size;
	a->kind = kind;
	if (name != NULL) snprintf(a->name, sizeof a->name, "%s", name);
	pthread_mutex_lock(&mu);
	a->next = allocs;
	allocs = a;
	pthread_mutex_unlock(&mu);
}

// take unlinks the allocation of kind based at base into *out.
static int take(uintptr_t base, enum kind kind, struct alloc *out) {
	int found = 0;
	pthread_mutex_lock(&mu);
	for (struct alloc **p = &allocs; *p != NULL; p = &(*p)->next) {
		if ((*p)->base == base && (*p)->kind == kind) {
			struct alloc *a = *p;
			*p = a->next;
			*out = *a;
			free(a);
			found = 1;
			break;
		}
	}
	pthread_mutex_unlock(&mu);
	return found;
}

// within reports whether [p, p+n) lies in one allocation of a kind in mask.
static int within(uintptr_t p, size_t n, int mask, struct alloc *out) {
	int found = 0;
	pthread_mutex_lock(&mu);
	for (struct alloc *a = allocs; a != NULL; a = a->next) {
		if ((mask & (1 << a->kind)) && p >= a->base && n <= a->size && p - a->base <= a->size - n) {
			if (out != NULL) *out = *a;
			found = 1;
			break;
		}
	}
	pthread_mutex_unlock(&mu);
	return found;
}

#define DEV_MASK ((1 << DEVICE) | (1 << IMPORTED))
#define PINNED_MASK (1 << PINNED)

CUresult CUDAAPI cuInit(unsigned int flags) { ENTER("cuInit"); return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

CUresult CUDAAPI cuDeviceGet(CUdevice *d, int ordinal) {
	ENTER("cuDeviceGet");
	if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
	*d = 0;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
	ENTER("cuDevicePrimaryCtxRetain");
	if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&mu);
	primary.refs++;
	pthread_mutex_unlock(&mu);
	*pctx = (CUcontext)&primary;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice dev) {
	ENTER("cuDevicePrimaryCtxRelease");
	CUresult r = CUDA_SUCCESS;
	pthread_mutex_lock(&mu);
	if (dev != 0 || primary.refs == 0) r = CUDA_ERROR_INVALID_CONTEXT;
	else primary.refs--;
	pthread_mutex_unlock(&mu);
	return r;
}

CUresult CUDAAPI cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active) {
	ENTER("cuDevicePrimaryCtxGetState");
	if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
	pthread_mutex_lock(&mu);
	*active = primary.refs > 0;
	pthread_mutex_unlock(&mu);
	*flags = 0;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) {
	ENTER_COUNTING("cuCtxSetCurrent", ctx != NULL);
	if (ctx != NULL && ctx != (CUcontext)&primary) return CUDA_ERROR_INVALID_CONTEXT;
	current = ctx;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuCtxSynchronize(void) {
	NEED_CTX("cuCtxSynchronize");
	sleep_until(atomic_load(&ctx_end));
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuStreamCreate(CUstream *s, unsigned int flags) {
	NEED_CTX("cuStreamCreate");
	(void)flags;
	*s = (CUstream)calloc(1, sizeof(struct stream));
	return *s == NULL ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
}

// stream is s's state; the legacy and per-thread default streams share one.
static struct stream *stream(CUstream s) {
	if (s == NULL || s == CU_STREAM_LEGACY || s == CU_STREAM_PER_THREAD) return &legacy;
	return (struct stream *)s;
}

CUresult CUDAAPI cuStreamDestroy(CUstream s) { NEED_CTX("cuStreamDestroy"); free(s); return CUDA_SUCCESS; }

CUresult CUDAAPI cuStreamSynchronize(CUstream s) {
	NEED_CTX("cuStreamSynchronize");
	sleep_until(atomic_load(&stream(s)->end));
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventCreate(CUevent *ev, unsigned int flags) {
	NEED_CTX("cuEventCreate");
	(void)flags;
	*ev = (CUevent)calloc(1, sizeof(struct event));
	return *ev == NULL ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventDestroy(CUevent ev) { NEED_CTX("cuEventDestroy"); free(ev); return CUDA_SUCCESS; }

CUresult CUDAAPI cuEventRecord(CUevent ev, CUstream s) {
	NEED_CTX("cuEventRecord");
	struct event *e = (struct event *)ev;
	struct stream *st = stream(s);
	long long d = delay(), t = now(), prev = atomic_load(&st->end), end;
	do {
		end = (prev > t ? prev : t) + d;
	} while (!atomic_compare_exchange_weak(&st->end, &prev, end));
	for (long long c = atomic_load(&ctx_end); c < end && !atomic_compare_exchange_weak(&ctx_end, &c, end);) {
	}
	atomic_store(&e->end, end);
	atomic_store(&e->pending, 2);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventQuery(CUevent ev) {
	NEED_CTX("cuEventQuery");
	struct event *e = (struct event *)ev;
	if (now() < atomic_load(&e->end)) return CUDA_ERROR_NOT_READY;
	int p = atomic_load(&e->pending);
	while (p > 0 && !atomic_compare_exchange_weak(&e->pending, &p, p - 1)) {
	}
	return p > 0 ? CUDA_ERROR_NOT_READY : CUDA_SUCCESS;
}

CUresult CUDAAPI cuEventSynchronize(CUevent ev) {
	NEED_CTX("cuEventSynchronize");
	struct event *e = (struct event *)ev;
	sleep_until(atomic_load(&e->end));
	atomic_store(&e->pending, 0);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemAlloc(CUdeviceptr *p, size_t n) {
	NEED_CTX("cuMemAlloc");
	if (n == 0) return CUDA_ERROR_INVALID_VALUE;
	char name[40];
	pthread_mutex_lock(&mu);
	snprintf(name, sizeof name, "/kvactors-fakecuda-%d-%lu", (int)getpid(), seq++);
	pthread_mutex_unlock(&mu);
	int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
	if (fd < 0) return CUDA_ERROR_OUT_OF_MEMORY;
	void *m = MAP_FAILED;
	if (ftruncate(fd, (off_t)n) == 0) m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m == MAP_FAILED) {
		shm_unlink(name);
		return CUDA_ERROR_OUT_OF_MEMORY;
	}
	add((uintptr_t)m, n, DEVICE, name);
	*p = (CUdeviceptr)(uintptr_t)m;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFree(CUdeviceptr p) {
	NEED_CTX("cuMemFree");
	struct alloc a;
	if (!take((uintptr_t)p, DEVICE, &a)) return CUDA_ERROR_INVALID_VALUE;
	munmap((void *)a.base, a.size);
	shm_unlink(a.name);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemGetAddressRange(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
	NEED_CTX("cuMemGetAddressRange");
	struct alloc a;
	if (!within((uintptr_t)p, 0, DEV_MASK, &a)) return CUDA_ERROR_NOT_FOUND;
	if (base != NULL) *base = (CUdeviceptr)a.base;
	if (size != NULL) *size = a.size;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
	NEED_CTX("cuIpcGetMemHandle");
	struct alloc a;
	if (!within((uintptr_t)p, 0, 1 << DEVICE, &a) || a.base != (uintptr_t)p) return CUDA_ERROR_INVALID_VALUE;
	struct fake_handle fh = {.magic = "fakecud", .pid = (int32_t)getpid(), .size = a.size};
	memcpy(fh.name, a.name, sizeof fh.name);
	memset(h, 0, sizeof *h);
	memcpy(h->reserved, &fh, sizeof fh);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcOpenMemHandle(CUdeviceptr *p, CUipcMemHandle h, unsigned int flags) {
	NEED_CTX("cuIpcOpenMemHandle");
	struct fake_handle fh;
	memcpy(&fh, h.reserved, sizeof fh);
	if (flags != CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS || memcmp(fh.magic, "fakecud", 8) != 0) return CUDA_ERROR_INVALID_VALUE;
	if (fh.pid == (int32_t)getpid()) return CUDA_ERROR_INVALID_CONTEXT;
	fh.name[sizeof fh.name - 1] = 0;
	int fd = shm_open(fh.name, O_RDWR, 0);
	if (fd < 0) return CUDA_ERROR_INVALID_HANDLE;
	void *m = mmap(NULL, fh.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (m == MAP_FAILED) return CUDA_ERROR_MAP_FAILED;
	add((uintptr_t)m, fh.size, IMPORTED, fh.name);
	*p = (CUdeviceptr)(uintptr_t)m;
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuIpcCloseMemHandle(CUdeviceptr p) {
	NEED_CTX("cuIpcCloseMemHandle");
	struct alloc a;
	if (!take((uintptr_t)p, IMPORTED, &a)) return CUDA_ERROR_INVALID_VALUE;
	munmap((void *)a.base, a.size);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemHostAlloc(void **pp, size_t n, unsigned int flags) {
	NEED_CTX("cuMemHostAlloc");
	(void)flags;
	if (n == 0 || posix_memalign(pp, 4096, n) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
	add((uintptr_t)*pp, n, PINNED, NULL);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemFreeHost(void *p) {
	NEED_CTX("cuMemFreeHost");
	struct alloc a;
	if (!take((uintptr_t)p, PINNED, &a)) return CUDA_ERROR_INVALID_VALUE;
	free(p);
	return CUDA_SUCCESS;
}

// copy checks both sides and copies; pinned says the host side must be
// cuMemHostAlloc memory (async copies).
static CUresult copy(const char *call, void *dst, const void *src, size_t n, uintptr_t dev, int pinned, uintptr_t host) {
	NEED_CTX(call);
	if (!within(dev, n, DEV_MASK, NULL)) return CUDA_ERROR_INVALID_VALUE;
	if (pinned && !within(host, n, PINNED_MASK, NULL)) return CUDA_ERROR_INVALID_VALUE;
	memmove(dst, src, n);
	return CUDA_SUCCESS;
}

CUresult CUDAAPI cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n) {
	return copy("cuMemcpyDtoH", dst, (void *)(uintptr_t)src, n, (uintptr_t)src, 0, (uintptr_t)dst);
}
CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr dst, const void *src, size_t n) {
	return copy("cuMemcpyHtoD", (void *)(uintptr_t)dst, src, n, (uintptr_t)dst, 0, (uintptr_t)src);
}
CUresult CUDAAPI cuMemcpyDtoHAsync(void *dst, CUdeviceptr src, size_t n, CUstream s) {
	(void)s;
	return copy("cuMemcpyDtoHAsync", dst, (void *)(uintptr_t)src, n, (uintptr_t)src, 1, (uintptr_t)dst);
}
CUresult CUDAAPI cuMemcpyHtoDAsync(CUdeviceptr dst, const void *src, size_t n, CUstream s) {
	(void)s;
	return copy("cuMemcpyHtoDAsync", (void *)(uintptr_t)dst, src, n, (uintptr_t)dst, 1, (uintptr_t)src);
}

CUresult CUDAAPI cuGetErrorName(CUresult e, const char **s) {
	switch (e) {
#define NAME(x) case x: *s = #x; return CUDA_SUCCESS;
	NAME(CUDA_SUCCESS) NAME(CUDA_ERROR_INVALID_VALUE) NAME(CUDA_ERROR_OUT_OF_MEMORY)
	NAME(CUDA_ERROR_NOT_INITIALIZED) NAME(CUDA_ERROR_INVALID_CONTEXT) NAME(CUDA_ERROR_INVALID_DEVICE)
	NAME(CUDA_ERROR_INVALID_HANDLE) NAME(CUDA_ERROR_NOT_FOUND) NAME(CUDA_ERROR_NOT_READY)
	NAME(CUDA_ERROR_ILLEGAL_ADDRESS) NAME(CUDA_ERROR_MAP_FAILED) NAME(CUDA_ERROR_NO_DEVICE)
#undef NAME
	default:
		*s = NULL;
		return CUDA_ERROR_INVALID_VALUE;
	}
}
