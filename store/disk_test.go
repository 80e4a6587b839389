package store

import (
	"errors"
	"fmt"
	"math/rand"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/disk"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/metrics"
	"github.com/kvactors/kvactors/sched"
)

// lockedDevice is memDevice safe for concurrent copies into disjoint blocks.
type lockedDevice struct {
	mu sync.Mutex
	memDevice
}

func (d *lockedDevice) Copy(dir backend.Direction, a backend.Arena, rs []backend.Range) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.memDevice.Copy(dir, a, rs)
}

// Stores and loads from several goroutines through a 16-chunk pool over a
// disk tier: chunks are evicted to disk and read back by loads all the time.
// Every successful load copies exactly the bytes stored for its key; the
// only failures are the expected ones (not ready, no room); the pool ends
// with nothing pending or pinned. Run under -race.
func TestConcurrentStoresAndLoadsOverDisk(t *testing.T) {
	const bb, srcBlocks, workers = 64, 200, 4
	l := mustLayout(t, 1, messages.Region{BlockStride: bb, BlockBytes: bb})
	dev := &lockedDevice{memDevice: memDevice{mem: make([]byte, (srcBlocks+workers)*bb)}}
	for i := range dev.mem[:srcBlocks*bb] {
		dev.mem[i] = byte(i*7 + i/251)
	}
	d, err := disk.Open(disk.Config{Dir: t.TempDir(), Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	s := New(heapArena(make([]byte, 16*bb)), bb, d, metrics.NewPool(nil))
	e := s.Engine("e", l, dev)
	key := func(i int) messages.Key { return messages.Key(fmt.Sprintf("k%03d", i)) }
	src := func(i int) messages.BlockID { return messages.BlockID(1 + i%(srcBlocks-1)) } // id 0 is the null block

	var wg sync.WaitGroup
	errs := make(chan error, workers)
	loaded := make([]int, workers)
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewSource(int64(w)))
			target := messages.BlockID(srcBlocks + w)
			for range 400 {
				i := rng.Intn(60)
				if rng.Intn(2) == 0 {
					prep, err := e.PrepareStore([]messages.Key{key(i)}, []int64{bb})
					if errors.Is(err, hostpool.ErrNoRoom) || (err == nil && len(prep.Keys) == 0) {
						continue
					}
					if err == nil {
						err = e.Copy(backend.DeviceToHost, []sched.JobChunk{{Key: key(i), Blocks: []messages.BlockID{src(i)}}}, nil)
					}
					if err != nil {
						errs <- fmt.Errorf("store %d: %w", i, err)
						return
					}
					continue
				}
				if _, err := e.PrepareLoad([]messages.Key{key(i)}); err != nil {
					if errors.Is(err, hostpool.ErrNotReady) || errors.Is(err, hostpool.ErrNoRoom) {
						continue
					}
					errs <- fmt.Errorf("prepare load %d: %w", i, err)
					return
				}
				if err := e.Copy(backend.HostToDevice, []sched.JobChunk{{Key: key(i), Blocks: []messages.BlockID{target}}}, nil); err != nil {
					errs <- fmt.Errorf("load %d: %w", i, err)
					return
				}
				dev.mu.Lock()
				got := string(dev.mem[int(target)*bb : int(target+1)*bb])
				want := string(dev.mem[int(src(i))*bb : int(src(i)+1)*bb])
				dev.mu.Unlock()
				if got != want {
					whose := -1
					for b := 0; b < srcBlocks; b++ {
						if string(dev.mem[b*bb:(b+1)*bb]) == got {
							whose = b
						}
					}
					errs <- fmt.Errorf("load %d returned other bytes (block %d's; zero %v)", i, whose, got == string(make([]byte, bb)))
					return
				}
				loaded[w]++
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("workers did not finish in 60s")
	}
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	st := s.Stats()
	require.Zero(t, st.Pending)
	require.Zero(t, st.Pinned)
	// Whether a racing load found its key on disk depends on the spill
	// writer's timing; once it has caught up, a key evicted from host memory
	// and written to disk must load from there byte for byte.
	onDisk := -1
	testkit.Eventually(t, 10*time.Second, 5*time.Millisecond, func() error {
		for i := range 60 {
			inHost, _ := s.pool.Lookup(key(i))
			if _, _, ok := d.Has(key(i)); ok && inHost != hostpool.Ready {
				onDisk = i
				return nil
			}
		}
		return fmt.Errorf("no key evicted from host memory is on disk yet")
	})
	hitsBefore := d.Stats().Hits
	_, err = e.PrepareLoad([]messages.Key{key(onDisk)})
	require.NoError(t, err)
	target := messages.BlockID(srcBlocks)
	require.NoError(t, e.Copy(backend.HostToDevice, []sched.JobChunk{{Key: key(onDisk), Blocks: []messages.BlockID{target}}}, nil))
	require.Equal(t, dev.mem[int(src(onDisk))*bb:int(src(onDisk)+1)*bb], dev.mem[int(target)*bb:int(target+1)*bb])
	d.Close()
	dst := d.Stats()
	t.Logf("loads ok per worker %v; disk: %d written, %d read back, %d raced, %d dropped", loaded, dst.Writes,
		dst.Hits, dst.Raced, dst.Dropped)
	require.Greater(t, dst.Hits, hitsBefore, "the key evicted from host memory came back from disk")
}

// refusesDisk maps every key to itself but no, which is not to be written
// to disk.
type refusesDisk struct{ no messages.Key }

func (r refusesDisk) ToDisk(k messages.Key) (messages.Key, bool) {
	if k == r.no {
		return "", false
	}
	return k, true
}

// A victim whose key the mapping refuses (DiskKeys.ToDisk's false: a
// namespace with no lasting disk key) is not spilled under any disk key;
// the next victim, which maps, is.
func TestAVictimWithNoDiskKeyIsNotSpilled(t *testing.T) {
	const bb = 64
	l := mustLayout(t, 1, messages.Region{BlockStride: bb, BlockBytes: bb})
	d, err := disk.Open(disk.Config{Dir: t.TempDir(), Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	s := New(heapArena(make([]byte, bb)), bb, d, metrics.NewPool(nil))
	s.UseDiskKeys(refusesDisk{no: "a"})
	e := s.Engine("e", l, &memDevice{mem: make([]byte, 4*bb)})
	storeChunks(t, e, chunk("a", 1))
	storeChunks(t, e, chunk("b", 2)) // evicts a
	storeChunks(t, e, chunk("c", 3)) // evicts b
	d.Close()                        // the queued spills written
	require.Equal(t, []messages.Key{"b"}, d.Keys())
}
