//go:build cuda

package cuda

// The driver calls gorgonia.org/cu does not wrap: IPC memory handles and
// pinned host memory. Each returns *Error naming the call on failure.

/*
#cgo LDFLAGS: -lcuda
#include <cuda.h>
#include <string.h>

// A CUipcMemHandle is passed by value; these copy it from and to a plain
// byte buffer so Go never needs the struct's layout.
static CUresult kva_ipc_open(CUdeviceptr *p, const void *handle) {
	CUipcMemHandle h;
	memcpy(h.reserved, handle, CU_IPC_HANDLE_SIZE);
	return cuIpcOpenMemHandle(p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
}

static CUresult kva_ipc_get(void *handle, CUdeviceptr p) {
	CUipcMemHandle h;
	CUresult r = cuIpcGetMemHandle(&h, p);
	if (r == CUDA_SUCCESS) {
		memcpy(handle, h.reserved, CU_IPC_HANDLE_SIZE);
	}
	return r;
}
*/
import "C"

import (
	"fmt"
	"reflect"
	"unsafe"

	"gorgonia.org/cu"
)

// Error is a failed CUDA driver call.
type Error struct {
	Call string // driver function, e.g. "cuIpcOpenMemHandle"
	Code int    // the CUresult
	Name string // its cuGetErrorName, e.g. "CUDA_ERROR_INVALID_VALUE"
	err  error  // gorgonia.org/cu's error value, when the call went through cu
}

func (e *Error) Error() string {
	return fmt.Sprintf("%s: %s (%d)", e.Call, e.Name, e.Code)
}

// Unwrap returns cu's error, so errors.Is(err, cu.InvalidValue) also works.
func (e *Error) Unwrap() error { return e.err }

// Sticky reports whether the error leaves the context unusable: the CUDA
// documentation says every later call in the process then fails the same way,
// so the backend reports it from Healthy and fails every later Copy.
// CUDA_ERROR_UNKNOWN is left out: drivers also use it for one bad argument.
func (e *Error) Sticky() bool {
	switch C.CUresult(e.Code) {
	case C.CUDA_ERROR_ILLEGAL_ADDRESS, C.CUDA_ERROR_LAUNCH_TIMEOUT,
		C.CUDA_ERROR_HARDWARE_STACK_ERROR, C.CUDA_ERROR_ILLEGAL_INSTRUCTION,
		C.CUDA_ERROR_MISALIGNED_ADDRESS, C.CUDA_ERROR_INVALID_ADDRESS_SPACE,
		C.CUDA_ERROR_INVALID_PC, C.CUDA_ERROR_LAUNCH_FAILED,
		C.CUDA_ERROR_ECC_UNCORRECTABLE, C.CUDA_ERROR_NVLINK_UNCORRECTABLE,
		C.CUDA_ERROR_CONTEXT_IS_DESTROYED, C.CUDA_ERROR_NOT_INITIALIZED,
		C.CUDA_ERROR_DEINITIALIZED, C.CUDA_ERROR_DEVICE_UNAVAILABLE,
		C.CUDA_ERROR_SYSTEM_NOT_READY:
		return true
	}
	return false
}

// result turns a CUresult into nil or *Error naming call.
func result(call string, r C.CUresult) error {
	if r == C.CUDA_SUCCESS {
		return nil
	}
	return &Error{Call: call, Code: int(r), Name: errorName(r)}
}

// check turns an error from gorgonia.org/cu into *Error naming call. cu's
// error type is an unexported integer type holding the CUresult; reflect
// reads the code so both paths name errors the same way.
func check(call string, err error) error {
	if err == nil {
		return nil
	}
	v := reflect.ValueOf(err)
	if !v.CanInt() {
		return fmt.Errorf("%s: %w", call, err)
	}
	r := C.CUresult(v.Int())
	return &Error{Call: call, Code: int(r), Name: errorName(r), err: err}
}

// errorName is cuGetErrorName, or the number for a code it does not know.
func errorName(r C.CUresult) string {
	var s *C.char
	if C.cuGetErrorName(r, &s) != C.CUDA_SUCCESS || s == nil {
		return fmt.Sprintf("CUresult(%d)", int(r))
	}
	return C.GoString(s)
}

// ipcOpen maps another process's allocation into the current context. Only
// from the worker goroutine.
func ipcOpen(h *[ipcHandleSize]byte) (cu.DevicePtr, error) {
	var p C.CUdeviceptr
	if err := result("cuIpcOpenMemHandle", C.kva_ipc_open(&p, unsafe.Pointer(&h[0]))); err != nil {
		return 0, err
	}
	return cu.DevicePtr(p), nil
}

// ipcClose unmaps an allocation opened by ipcOpen. Only from the worker.
func ipcClose(p cu.DevicePtr) error {
	return result("cuIpcCloseMemHandle", C.cuIpcCloseMemHandle(C.CUdeviceptr(p)))
}

// ipcHandle exports the allocation based at p. Only from the worker.
func ipcHandle(p cu.DevicePtr) ([ipcHandleSize]byte, error) {
	var h [ipcHandleSize]byte
	err := result("cuIpcGetMemHandle", C.kva_ipc_get(unsafe.Pointer(&h[0]), C.CUdeviceptr(p)))
	return h, err
}

// hostAlloc returns page-locked host memory. PORTABLE makes it count as
// pinned in every context, so an arena may serve devices of other contexts;
// DEVICEMAP is not asked for since copies are explicit, never zero-copy
// kernel access. Only from the worker.
func hostAlloc(n int64) (unsafe.Pointer, error) {
	var p unsafe.Pointer
	if err := result("cuMemHostAlloc", C.cuMemHostAlloc(&p, C.size_t(n), C.CU_MEMHOSTALLOC_PORTABLE)); err != nil {
		return nil, err
	}
	if p == nil {
		return nil, &Error{Call: "cuMemHostAlloc", Code: int(C.CUDA_ERROR_OUT_OF_MEMORY), Name: errorName(C.CUDA_ERROR_OUT_OF_MEMORY)}
	}
	return p, nil
}

// hostFree frees memory from hostAlloc. Only from the worker.
func hostFree(p unsafe.Pointer) error {
	return result("cuMemFreeHost", C.cuMemFreeHost(p))
}
