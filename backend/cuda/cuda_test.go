//go:build cuda

package cuda

// These tests need a CUDA GPU: gorgonia.org/cu's init exits the process
// without one. scripts/cuda-check only compiles and links them.

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/stretchr/testify/require"
	"gorgonia.org/cu"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/backend/backendtest"
	"github.com/kvactors/kvactors/messages"
)

// TestConformanceDirect runs the suite on buffers attached by pointer: every
// part of the copy path except cuIpcOpenMemHandle itself.
func TestConformanceDirect(t *testing.T) {
	backendtest.Run(t, directHarness())
}

// TestConformanceIPC runs the suite with a child process as the engine, so
// segments are opened with cuIpcOpenMemHandle as in production.
func TestConformanceIPC(t *testing.T) {
	skipWithoutIPC(t)
	backendtest.Run(t, ipcHarness())
}

// skipWithoutIPC skips when the driver refuses IPC between two processes
// (some containers and virtualised GPUs do): no child engine could attach.
func skipWithoutIPC(t *testing.T) {
	t.Helper()
	e := startEngine(t, []int64{4096})
	dev, err := openBackend(t).Attach("probe", e.specs)
	if err != nil && refusedIPC(err) {
		t.Skipf("cuIpcOpenMemHandle refused between processes here: %v", err)
	}
	require.NoError(t, err)
	require.NoError(t, dev.Close())
}

// refusedIPC reports the errors a driver gives when it does not support
// opening this handle here, as opposed to a bug in the backend.
func refusedIPC(err error) bool {
	var e *Error
	return errors.As(err, &e) && e.Call == "cuIpcOpenMemHandle" &&
		(e.Code == int(cu.InvalidContext) || e.Code == int(cu.InvalidValue) || e.Code == int(cu.NotSupported))
}

// TestAttachSameProcess: CUDA documents no way to open a handle the process
// exported itself, and drivers answer CUDA_ERROR_INVALID_CONTEXT or
// CUDA_ERROR_INVALID_VALUE; if this one allows it, the bytes must match.
func TestAttachSameProcess(t *testing.T) {
	b := openBackend(t)
	buf, err := b.AllocDevice(1 << 20)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, buf.Free()) })
	want := random(1, 1<<20)
	require.NoError(t, buf.Write(0, want))

	dev, err := b.Attach("self", []messages.Segment{buf.Segment()})
	if err != nil && refusedIPC(err) {
		t.Skipf("same-process cuIpcOpenMemHandle refused (%v); TestConformanceDirect and TestConformanceIPC cover the copy and IPC paths", err)
	}
	require.NoError(t, err)
	defer func() { require.NoError(t, dev.Close()) }()
	arena := allocArena(t, b, 1<<20)
	require.NoError(t, dev.Copy(backend.DeviceToHost, arena, []backend.Range{{Len: 1 << 20}}))
	require.True(t, bytes.Equal(want, arena.Bytes()), "bytes copied through a same-process IPC mapping differ")
}

// TestAttachErrorsNameTheCall: a driver error fails Attach with the call and
// the CUDA error name, and does not mark the context broken.
func TestAttachErrorsNameTheCall(t *testing.T) {
	b := openBackend(t)
	seg := messages.Segment{CUDAIPC: handleHex, Device: testDevice(), Bytes: 4096}
	_, err := b.Attach("bogus", []messages.Segment{seg})
	require.ErrorContains(t, err, "cuIpcOpenMemHandle: CUDA_ERROR_")
	var e *Error
	require.ErrorAs(t, err, &e)
	require.False(t, e.Sticky())
	require.NoError(t, b.Healthy())

	_, err = b.Attach("shm", []messages.Segment{{Shm: "kvactors-e1"}})
	require.ErrorIs(t, err, backend.ErrBadSegment)
}

// TestCopyPatterns: many small ranges, merged or not, in both directions and
// in any order, land byte for byte.
func TestCopyPatterns(t *testing.T) {
	const size, block = 8 << 20, 4096
	b := openBackend(t)
	buf, err := b.AllocDevice(size)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, buf.Free()) })
	dev, err := b.attachPointers([]cu.DevicePtr{buf.ptr}, []int64{size})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, dev.Close()) })
	arena := allocArena(t, b, size)
	src := random(2, size)
	require.NoError(t, buf.Write(0, src))

	n := size / block
	adjacent := make([]backend.Range, n)
	for i := range adjacent {
		adjacent[i] = backend.Range{SegOffset: int64(i * block), PoolOff: int64(i * block), Len: block}
	}
	shuffled := make([]backend.Range, n)
	for i, j := range rand.New(rand.NewPCG(3, 4)).Perm(n) {
		shuffled[i] = backend.Range{SegOffset: int64(j * block), PoolOff: int64((n - 1 - j) * block), Len: block}
	}

	t.Run("adjacent store merges to one copy", func(t *testing.T) {
		clear(arena.Bytes())
		require.NoError(t, dev.Copy(backend.DeviceToHost, arena, adjacent))
		require.True(t, bytes.Equal(src, arena.Bytes()))
	})
	t.Run("shuffled store reverses blocks", func(t *testing.T) {
		clear(arena.Bytes())
		require.NoError(t, dev.Copy(backend.DeviceToHost, arena, shuffled))
		got := arena.Bytes()
		for i := range n {
			require.True(t, bytes.Equal(src[i*block:(i+1)*block], got[(n-1-i)*block:(n-i)*block]), "block %d", i)
		}
	})
	t.Run("load back restores the device", func(t *testing.T) {
		require.NoError(t, buf.Write(0, make([]byte, size)))
		require.NoError(t, dev.Copy(backend.HostToDevice, arena, shuffled))
		got := make([]byte, size)
		require.NoError(t, buf.Read(0, got))
		require.True(t, bytes.Equal(src, got))
	})
	t.Run("foreign arena is copied synchronously", func(t *testing.T) {
		plain := sliceArena(make([]byte, size))
		require.NoError(t, dev.Copy(backend.DeviceToHost, plain, adjacent))
		require.True(t, bytes.Equal(src, plain))
	})
}

func TestHealthyAndClose(t *testing.T) {
	b, err := Open(Config{Device: testDevice()})
	require.NoError(t, err)
	require.Equal(t, "cuda", b.Name())
	require.NoError(t, b.Healthy())
	arena, err := b.AllocArena(4096)
	require.NoError(t, err)
	require.NoError(t, b.Close(), "Close frees what is left")
	require.ErrorIs(t, b.Healthy(), backend.ErrClosed)
	require.NoError(t, arena.Close(), "arena already freed by the backend's Close")
	_, err = b.AllocArena(4096)
	require.ErrorIs(t, err, backend.ErrClosed)
}

// sliceArena is host memory the backend did not allocate.
type sliceArena []byte

func (a sliceArena) Bytes() []byte { return a }
func (sliceArena) Close() error    { return nil }

func allocArena(t testing.TB, b *Backend, n int64) backend.Arena {
	t.Helper()
	a, err := b.AllocArena(n)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, a.Close()) })
	return a
}

func random(seed uint64, n int) []byte {
	var s [32]byte
	s[0] = byte(seed)
	p := make([]byte, n)
	_, _ = rand.NewChaCha8(s).Read(p)
	return p
}

// TestInjectedErrors needs scripts/cuda-check's fake driver
// (testdata/fakecuda.c), which can make one call fail on demand: a failed
// enqueue fails only its Copy; an error that breaks the context fails that
// Copy, shows in Healthy, and fails every later Copy.
func TestInjectedErrors(t *testing.T) {
	if os.Getenv("KVACTORS_FAKECUDA") == "" {
		t.Skip("needs the fake driver of scripts/cuda-check (KVACTORS_FAKECUDA=1)")
	}
	b := openBackend(t)
	buf, err := b.AllocDevice(1 << 16)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, buf.Free()) })
	dev, err := b.attachPointers([]cu.DevicePtr{buf.ptr}, []int64{1 << 16})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, dev.Close()) })
	arena := allocArena(t, b, 1<<16)
	ranges := []backend.Range{{Len: 4096}, {SegOffset: 8192, PoolOff: 8192, Len: 4096}}

	t.Setenv("FAKECUDA_FAIL", "cuMemcpyDtoHAsync=1")
	err = dev.Copy(backend.DeviceToHost, arena, ranges)
	require.ErrorContains(t, err, "cuMemcpyDtoHAsync: CUDA_ERROR_INVALID_VALUE (1)")
	require.NoError(t, b.Healthy(), "a refused copy does not break the context")
	t.Setenv("FAKECUDA_FAIL", "")
	require.NoError(t, dev.Copy(backend.DeviceToHost, arena, ranges))

	t.Setenv("FAKECUDA_FAIL", "cuEventQuery=700")
	err = dev.Copy(backend.DeviceToHost, arena, ranges)
	require.ErrorContains(t, err, "cuEventQuery: CUDA_ERROR_ILLEGAL_ADDRESS (700)")
	t.Setenv("FAKECUDA_FAIL", "")
	var e *Error
	require.ErrorAs(t, b.Healthy(), &e)
	require.True(t, e.Sticky())
	require.ErrorContains(t, dev.Copy(backend.HostToDevice, arena, ranges), "context unusable")
}
