package node_test

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/messages"
)

// restartEngine plays an engine process that restarts: it unlinks its shm
// object and creates a new one under the same name (new memory, zeroed),
// then registers again with the very same spec well within lease/2.
func restartEngine(t *testing.T, e *env, te *testEngine) {
	t.Helper()
	size := int64(len(te.seg.Bytes()))
	require.NoError(t, te.seg.Remove())
	seg, err := shm.Create(e.dir, te.seg.Name(), size)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Remove() })
	te.seg = seg
	te.register()
	te.epoch, te.seq = te.epoch+"-restarted", 0
}

// storeAndLoad has request req store blocks 40..43 (filled with gen) under
// hashes of family fam, then loads them into blocks 50..53, and checks the
// load brings back exactly what the engine wrote.
func storeAndLoad(t *testing.T, te *testEngine, req, fam string, gen byte) {
	t.Helper()
	var want [][]byte
	hs := make([]string, 4)
	for i := range 4 {
		te.fill(0, messages.BlockID(40+i), gen)
		want = append(want, bytes.Clone(te.block(0, messages.BlockID(40+i))))
		hs[i] = hash(fam, i)
	}
	te.send(added(req, 16), hashesEv(req, 0, hs...), blocksEv(req, 0, 0, 40, 41, 42, 43), tokensEv(req, 16, 16))
	recv(t, te.stored, req+"'s store")
	require.Equal(t, 16, te.lookup(hs))
	r := te.loadInto(req+"-load", hs, 16, []int{50, 51, 52, 53})
	require.True(t, r.OK, r.Error)
	for i := range 4 {
		require.Equal(t, want[i], te.block(0, messages.BlockID(50+i)),
			"block %d: a load answered ok brings back what the engine stored", 50+i)
	}
}

// PROTOCOL.md "EngineSpec": an identical spec is a no-op only while its
// segment names still name the objects the node mapped. A restarted engine
// that recreated its object under the same name is remapped (an engine
// reset): otherwise the node would keep copying to and from the dead
// process's unlinked object, storing its bytes under the new process's
// hashes and answering loads ok that land where the engine never looks.
func TestARestartedEngineWithTheSameSpecIsRemapped(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("vic", defaultOpts())
	te.register()
	storeAndLoad(t, te, "old", "a", 1)

	restartEngine(t, e, te)
	storeAndLoad(t, te, "new", "b", 2)
}

// The restarted engine's stores must read the new object: the chunk stored
// under its hashes holds what it wrote, also when a later register (a real
// spec change) has the node map the current object for the load.
func TestARestartedEngineNeverStoresTheDeadProcessBytes(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("vic", defaultOpts())
	te.register()
	for i := range 4 {
		te.fill(0, messages.BlockID(40+i), 1) // the dead process's bytes
	}
	restartEngine(t, e, te)
	var want [][]byte
	hs := make([]string, 4)
	for i := range 4 {
		te.fill(0, messages.BlockID(40+i), 2)
		want = append(want, bytes.Clone(te.block(0, messages.BlockID(40+i))))
		hs[i] = hash("b", i)
	}
	te.send(added("r", 16), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 40, 41, 42, 43), tokensEv("r", 16, 16))
	recv(t, te.stored, "r's store")

	te.spec.MaxModelLen = 128 // same geometry: the namespace keeps its chunks
	te.register()
	te.epoch, te.seq = "ep3", 0
	r := te.loadInto("l", hs, 16, []int{50, 51, 52, 53})
	require.True(t, r.OK, r.Error)
	for i := range 4 {
		require.Equal(t, want[i], te.block(0, messages.BlockID(50+i)),
			"block %d: the chunk stored under the new hashes holds what the new process wrote", 50+i)
	}
}

// A same-spec register while the engine's object is gone (unlinked, not yet
// created again) is handled as a new spec: the attach fails and the register
// is refused, naming the segment, instead of answering ok over the mapping
// of an object nobody can reach.
func TestASameSpecRegisterWhoseObjectIsGoneIsRefused(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	te := e.newEngine("vic", defaultOpts())
	te.register()
	require.NoError(t, te.seg.Remove())
	reply := string(te.request("register", te.spec))
	require.Contains(t, reply, `"error"`)
	require.Contains(t, reply, "does not exist")
	require.Contains(t, reply, te.seg.Name())
}
