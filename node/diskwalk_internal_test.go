package node

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A namespace's first register in a boot walks the disk index to tell
// routers of its chunks on disk (tens of ms for a million records). It used
// to walk under n.mu, which every engine's lookups, loads, heartbeats and
// registers take: here engine e2's record (what its lookups and loads look
// up, n.engine) is found while e1's walk is held at its record, and e1's
// register is answered only once the walk has ended.
func TestANamespacesDiskWalkDoesNotHoldTheNodeLock(t *testing.T) {
	t.Parallel()
	withDisk := diskOfAnEarlierBoot(t, spilled{"6161616130303030", 1024}) // one chunk of e1's namespace

	// The next boot on that disk: e2 first, then e1, whose register walks.
	n2, nc2, dir2 := startInternal(t, withDisk)
	registerOneEngine(t, nc2, dir2, "e2")
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	n2.mu.Lock()
	n2.diskWalked = func() { once.Do(func() { close(entered); <-release }) }
	n2.mu.Unlock()
	registered := make(chan error, 1)
	go func() { registered <- tryRegister(t, nc2, dir2, "e1") }()
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("e1's register did not walk its record on disk")
	}

	found := make(chan *engineRec, 1)
	go func() { found <- n2.engine("e2") }()
	select {
	case rec := <-found:
		require.NotNil(t, rec, "e2 is registered")
	case <-time.After(5 * time.Second):
		close(release) // lets the register, then the lookup of e2, go on
		t.Fatal("n.mu was held during the disk walk: e2's record was not found")
	}
	select {
	case err := <-registered:
		t.Fatalf("e1's register was answered (%v) before its disk walk ended", err)
	default:
	}
	close(release)
	select {
	case err := <-registered:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		t.Fatal("e1's register was not answered after its walk")
	}
	require.Equal(t, 4, lookupHits(t, nc2, "6161616130303030"), "the chunk on disk is served")
}
