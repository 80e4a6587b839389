package store

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// hookWaker runs fn on another goroutine when woken and waits for it: it
// stands for another goroutine that runs in the window between the two
// critical sections of a failed load's completion (CompleteStore(keys, nil),
// whose wake-ups run after its lock is released, then CompleteLoad(keys)).
type hookWaker struct{ fn func() }

func (h *hookWaker) Wake() {
	if h.fn == nil {
		return
	}
	fn := h.fn
	h.fn = nil
	done := make(chan struct{})
	go func() { fn(); close(done) }()
	<-done
}

// A load whose read back from disk fails ends in one step (Engine.complete,
// hostpool.By.EndLoad): its pending room is freed and its pins dropped
// under one lock. In two steps (CompleteStore(keys, nil), whose wake-ups
// run after its lock is released, then CompleteLoad(keys), which unpins by
// key), another load could store the key again and pin it in between, and
// the failed load's unpin would take that load's pin, leaving the chunk it
// copies evictable. The waker runs that other load in the window.
func TestAFailedReadBackKeepsAnotherLoadsPin(t *testing.T) {
	l := mustLayout(t, 1, messages.Region{BlockStride: testBlockBytes, BlockBytes: testBlockBytes})
	dev := &memDevice{mem: make([]byte, 8*testBlockBytes)}
	for i := range dev.mem {
		dev.mem[i] = byte(i*7 + i/251)
	}
	d, err := disk.Open(disk.Config{Dir: t.TempDir(), Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	s := New(heapArena(make([]byte, 2*testBlockBytes)), testBlockBytes, d, metrics.NewPool(nil)) // two chunks
	e := s.Engine("e", l, dev)
	storeChunks(t, e, chunk("a", 1))
	storeChunks(t, e, chunk("b", 2))
	storeChunks(t, e, chunk("c", 3)) // evicts a, written to disk
	testkit.Eventually(t, 10*time.Second, 5*time.Millisecond, func() error {
		if _, _, ok := d.Has("a"); !ok {
			return fmt.Errorf("a not on disk yet")
		}
		return nil
	})

	// Load 1: room to read a back into (evicts b).
	_, err = e.PrepareLoad([]messages.Key{"a"})
	require.NoError(t, err)
	// Its read back will fail: a leaves the disk meanwhile (disk LRU, or a
	// bad record found by another read).
	d.Drop("e", "a")

	// Load 2, in the window: a is stored again from the device and pinned.
	pinnedByLoad2 := false
	w := &hookWaker{fn: func() {
		prep, err := e.PrepareStore([]messages.Key{"a"}, []int64{testBlockBytes})
		if err != nil || len(prep.Keys) != 1 {
			t.Errorf("store a again: %v %v", prep.Keys, err)
			return
		}
		if err := e.Copy(backend.DeviceToHost, []sched.JobChunk{chunk("a", 1)}, nil); err != nil {
			t.Errorf("copy a: %v", err)
			return
		}
		if _, err := e.PrepareLoad([]messages.Key{"a"}); err != nil {
			t.Errorf("load 2 prepare: %v", err)
			return
		}
		pinnedByLoad2 = true
	}}
	e.WaitPending([]messages.Key{"a"}, w)

	err = e.Copy(backend.HostToDevice, []sched.JobChunk{chunk("a", 5)}, nil) // load 1: read back fails
	require.Error(t, err)
	require.True(t, pinnedByLoad2)

	// Load 2 has not completed: a must still be pinned.
	assert.Equal(t, 1, s.Stats().Pinned, "load 2's pin on a was taken by load 1's failed completion")
	// And so it must not be evictable.
	prep, err := e.PrepareStore([]messages.Key{"x", "y"}, []int64{testBlockBytes, testBlockBytes})
	if err == nil {
		assert.NotContains(t, prep.Evicted, messages.Key("a"), "a chunk pinned by a running load was evicted")
	}
}

// The same for a load aborted while queued (cancelled, or refused by the
// fence or engine silence: transfer's abort): another load's pin on a key
// stored again between freeing the aborted load's room and its unpin
// stays.
func TestAnAbortedLoadKeepsAnotherLoadsPin(t *testing.T) {
	l := mustLayout(t, 1, messages.Region{BlockStride: testBlockBytes, BlockBytes: testBlockBytes})
	dev := &memDevice{mem: make([]byte, 8*testBlockBytes)}
	for i := range dev.mem {
		dev.mem[i] = byte(i*7 + i/251)
	}
	d, err := disk.Open(disk.Config{Dir: t.TempDir(), Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	t.Cleanup(d.Close)
	s := New(heapArena(make([]byte, 2*testBlockBytes)), testBlockBytes, d, metrics.NewPool(nil))
	e := s.Engine("e", l, dev)
	storeChunks(t, e, chunk("a", 1))
	storeChunks(t, e, chunk("b", 2))
	storeChunks(t, e, chunk("c", 3))
	testkit.Eventually(t, 10*time.Second, 5*time.Millisecond, func() error {
		if _, _, ok := d.Has("a"); !ok {
			return fmt.Errorf("a not on disk yet")
		}
		return nil
	})
	_, err = e.PrepareLoad([]messages.Key{"a"}) // load 1, queued
	require.NoError(t, err)
	w := &hookWaker{fn: func() { // load 2, between load 1's two completion steps
		prep, err := e.PrepareStore([]messages.Key{"a"}, []int64{testBlockBytes})
		if err != nil || len(prep.Keys) != 1 {
			t.Errorf("store a again: %v %v", prep.Keys, err)
			return
		}
		if err := e.Copy(backend.DeviceToHost, []sched.JobChunk{chunk("a", 1)}, nil); err != nil {
			t.Errorf("copy a: %v", err)
			return
		}
		if _, err := e.PrepareLoad([]messages.Key{"a"}); err != nil {
			t.Errorf("load 2 prepare: %v", err)
		}
	}}
	e.WaitPending([]messages.Key{"a"}, w)
	e.Abort(backend.HostToDevice, []sched.JobChunk{chunk("a", 5)}) // load 1 cancelled while queued
	assert.Equal(t, 1, s.Stats().Pinned, "load 2's pin on a was taken by load 1's abort")
}
