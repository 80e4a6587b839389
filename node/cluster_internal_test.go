package node

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/internal/testkit"
)

type countingDevice struct {
	backend.Attachment
	copies int
}

func (d *countingDevice) Copy(backend.Direction, backend.Arena, []backend.Range) error {
	d.copies++
	return nil
}

// A copy for an engine whose claim may have lapsed never reaches the
// device; while the claim holds, copies pass through.
func TestOwnedDeviceRefusesCopiesOnceTheClaimMayHaveLapsed(t *testing.T) {
	inner := &countingDevice{}
	serving := true
	d := &ownedDev{Attachment: inner, engine: "e1", serving: func() bool { return serving }}
	require.NoError(t, d.Copy(backend.HostToDevice, nil, nil))
	require.Equal(t, 1, inner.copies)
	serving = false
	err := d.Copy(backend.DeviceToHost, nil, nil)
	require.True(t, errors.Is(err, errNotOwner), "%v", err)
	require.Contains(t, err.Error(), "e1")
	require.Equal(t, 1, inner.copies, "the device was not touched")
	require.Equal(t, backend.Attachment(inner), (&Node{}).ownedDevice("e1", inner), "no wrapper without a cluster")
}

// An engine that ended here (an expiry or unregister detached it) and
// registered again while its end still ran keeps the claim it registered
// under: the end's release of the claim checks, under the claim lock,
// that no engine of that id is registered. Once it is gone for good, the
// claim is given up.
func TestAnEndedEnginesClaimIsKeptIfItRegisteredAgain(t *testing.T) {
	t.Parallel()
	n, nc, dir := startInternal(t, func(c *Config) { c.Cluster, c.ClusterReplicas, c.NodeID = true, 1, "n1" })

	registerOneEngine(t, nc, dir, "e1")
	require.True(t, n.serving("e1", "events"))
	old := n.detach("e1", nil) // as an expiry does, before its end runs
	require.NotNil(t, old)

	// The release after the end holds the claim lock: a register waits.
	unlock := n.claimLock("e1")
	registered := make(chan error, 1)
	go func() { registered <- tryRegister(t, nc, dir, "e1") }()
	testkit.NoRecv(t, registered, 100*time.Millisecond, "a register while the claim lock is held")
	require.Nil(t, n.engine("e1"), "registered under the claim lock")
	unlock()
	require.NoError(t, testkit.Recv(t, registered, 5*time.Second, "the register once the lock is free"))

	_, err := n.end(context.Background(), old, nil) // the first end, done
	require.NoError(t, err)
	n.releaseClaimIfGone("e1")
	require.True(t, n.serving("e1", "events"), "the claim of the engine registered again was given up")

	require.NotNil(t, n.detach("e1", nil))
	n.releaseClaimIfGone("e1")
	require.False(t, n.serving("e1", "events"), "the claim of an engine gone for good was kept")
}

// keyedLocks: one key's lock does not wait on another's, a key's lock is
// exclusive, and a key nobody holds or waits for is forgotten.
func TestKeyedLocksAreOnePerKey(t *testing.T) {
	var k keyedLocks
	unlockA := k.lock("a")
	unlockB := k.lock("b") // a different key: no wait
	got, done := make(chan struct{}, 1), make(chan struct{})
	go func() {
		defer close(done)
		defer k.lock("a")()
		got <- struct{}{}
	}()
	testkit.NoRecv(t, got, 50*time.Millisecond, "a second holder of key a")
	unlockA()
	testkit.Recv(t, got, 5*time.Second, "key a once released")
	<-done
	unlockB()
	k.mu.Lock()
	defer k.mu.Unlock()
	require.Empty(t, k.keys, "keys nobody holds are kept")
}

// An unregister whose end outlives the shutdown timeout (a copy still in
// flight) answers with an error, keeps the claim while the copy runs, and
// gives the claim up once the engine actor has stopped: never a claim
// renewed for an engine this node no longer serves, which would have every
// other node refuse it.
func TestATimedOutEndReleasesTheClaimOnceItsCopyEnds(t *testing.T) {
	t.Parallel()
	dev := &toldDevice{copies: make(chan backend.Direction, 16), hold: make(chan struct{})}
	release := sync.OnceFunc(func() { close(dev.hold) })
	t.Cleanup(release)
	n, nc, dir := startInternal(t, func(c *Config) {
		c.Cluster, c.ClusterReplicas, c.NodeID = true, 1, "n1"
		c.ShutdownTimeout = 200 * time.Millisecond
		c.WrapDevice = func(d backend.Attachment) backend.Attachment { dev.Attachment = d; return dev }
	})
	registerOneEngine(t, nc, dir, "e1")
	require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"a","seq":1,"events":[`+
		`{"type":"added","request":"a","prompt_tokens":4},{"type":"hashes","request":"a","start":0,"hashes":["6161616130303030"]},`+
		`{"type":"blocks","request":"a","group":0,"start":0,"ids":[1]},{"type":"tokens","request":"a","computed":4,"total":4}]}`)))
	testkit.Recv(t, dev.copies, 5*time.Second, "the store's copy, held")

	reply, err := testkit.EngineRequest(nc, "e1", "kvactors.e1.unregister", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), "still in flight")
	require.True(t, n.serving("e1", "events"), "the claim given up under a running copy")

	release()
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if n.cl.owners.Serving("e1", time.Now()) {
			return fmt.Errorf("the claim is still held")
		}
		return nil
	})
}

// Whether an engine's segment is on this host is asked of the name itself:
// a symbolic link is not followed, so a link's target (any path on the
// host) is not probed through which node claims.
func TestBackendHasFollowsNoLink(t *testing.T) {
	dir := t.TempDir()
	n := &Node{cfg: Config{Backend: "shm", ShmDir: dir}}
	require.NoError(t, os.WriteFile(filepath.Join(dir, "e1-kv"), []byte("x"), 0o600))
	require.NoError(t, os.Symlink(filepath.Join(dir, "e1-kv"), filepath.Join(dir, "e1-link")))
	require.NoError(t, os.Mkdir(filepath.Join(dir, "e1-dir"), 0o700))
	require.True(t, n.backendHas("e1-kv"))
	require.False(t, n.backendHas("e1-link"), "a link to a regular file")
	require.False(t, n.backendHas("e1-dir"))
	require.False(t, n.backendHas("e1-none"))
}
