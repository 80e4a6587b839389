package node_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// protocolSpecFor is PROTOCOL.md's EngineSpec example with its segment
// renamed.
func protocolSpecFor(shmName string) string {
	return `{
  "tokens_per_hash": 4,
  "blocks_per_chunk": 3,
  "num_gpu_blocks": 1024,
  "offload_prompt_only": false,
  "segments": [{"shm": "` + shmName + `"}],
  "groups": [
    {"kind": "full", "tokens_per_block": 4,
     "regions": [{"segment": 0, "offset": 0, "block_stride": 4096, "block_bytes": 4096}]},
    {"kind": "sliding_window", "tokens_per_block": 4, "sliding_window": 8,
     "regions": [{"segment": 0, "offset": 4194304, "block_stride": 4096, "block_bytes": 4096}]}
  ]
}`
}

// fuzzAttackers are the ids a fuzzed register comes from; "vic" is the
// victim, registered once and never fuzzed.
var fuzzAttackers = []string{"e1", "e2", "mal", "kvactors"}

// FuzzRegister sends hostile specs (names, links, sizes) through the real
// register path of a real node whose shm directory holds every kind of
// object an attacker could point at. Invariants: every reply is exactly one
// of ok or error; an accepted spec names only segments that are its
// engine's (id + '-' or '.') and are regular one-link files; the victim's
// memory and a file outside the directory are never changed; the victim
// stays registered and answers. Seeded with PROTOCOL.md's example.
func FuzzRegister(f *testing.F) {
	dir, outside := f.TempDir(), filepath.Join(f.TempDir(), "secret")
	secret := bytes.Repeat([]byte("s3cret"), 1<<16)
	require.NoError(f, os.WriteFile(outside, secret, 0o600))
	owned := map[string]bool{}
	for name, size := range map[string]int64{"e1-kv": 8 << 20, "e1.kv": 64 << 10, "e2-kv": 8 << 20,
		"mal-kv": 4096, "kvactors-e1": 8 << 20} {
		seg, err := shm.Create(dir, name, size)
		require.NoError(f, err)
		f.Cleanup(func() { _ = seg.Remove() })
		owned[name] = true
	}
	vicSeg, err := shm.Create(dir, "vic-kv", 8<<20)
	require.NoError(f, err)
	f.Cleanup(func() { _ = vicSeg.Remove() })
	for i := range vicSeg.Bytes() {
		vicSeg.Bytes()[i] = byte(i * 7)
	}
	vicWant := bytes.Clone(vicSeg.Bytes())
	require.NoError(f, os.Link(outside, filepath.Join(dir, "e1-hard")))
	require.NoError(f, os.Symlink(outside, filepath.Join(dir, "e1-sym")))
	require.NoError(f, unix.Mkfifo(filepath.Join(dir, "e1-fifo"), 0o600))
	require.NoError(f, os.Mkdir(filepath.Join(dir, "e1-dir"), 0o700))
	require.NoError(f, os.WriteFile(filepath.Join(dir, "e1-empty"), nil, 0o600))

	// The victim sends no heartbeats: a lease longer than any fuzz run keeps
	// it from expiring (a slow run once outlived the 10 s default, and the
	// victim "left" for that reason, not the fuzzer's).
	n, err := node.Start(context.Background(), node.Config{NATSPort: -1, ShmDir: dir, PoolBytes: 1 << 20,
		Lease: time.Hour, HTTPAddr: node.HTTPOff, Registry: prometheus.NewRegistry(),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(f, err)
	f.Cleanup(func() { _ = n.Close(context.Background()) })
	nc, err := nats.Connect(n.NATSURL())
	require.NoError(f, err)
	f.Cleanup(nc.Close)
	request := func(t testing.TB, subject string, body []byte) []byte {
		m, err := testkit.EngineRequest(nc, strings.Split(subject, ".")[1], subject, body, 5*time.Second)
		require.NoError(t, err, subject)
		return m.Data
	}
	require.Contains(f, string(request(f, "kvactors.vic.register", []byte(protocolSpecFor("vic-kv")))), `"ok":true`)

	for i, name := range []string{"e1-kv", "e1.kv", "e2-kv", "vic-kv", "e1-hard", "e1-sym", "e1-fifo", "e1-dir",
		"e1-empty", "kvactors-e1", "../vic-kv", "e1-kv/..", "e1-missing"} {
		f.Add(uint8(i), []byte(protocolSpecFor(name)))
	}
	f.Add(uint8(0), []byte(strings.Replace(protocolSpecFor("e1-kv"), `"num_gpu_blocks": 1024`, `"num_gpu_blocks": 4294967296`, 1)))
	f.Add(uint8(0), []byte(strings.Replace(protocolSpecFor("e1.kv"), `"block_stride": 4096`, `"block_stride": 9223372036854775807`, 1)))
	f.Add(uint8(0), []byte(strings.Replace(protocolSpecFor("e1-kv"), `"offload_prompt_only": false`, `"namespace": "vic", "max_model_len": -1`, 1)))

	f.Fuzz(func(t *testing.T, who uint8, spec []byte) {
		id := fuzzAttackers[int(who)%len(fuzzAttackers)]
		var reply messages.RegisterReply
		require.NoError(t, json.Unmarshal(request(t, "kvactors."+id+".register", spec), &reply))
		require.True(t, reply.OK != (reply.Error != ""), "exactly one of ok or error: %+v", reply)
		if reply.OK {
			var s messages.EngineSpec
			require.NoError(t, json.Unmarshal(spec, &s))
			for _, seg := range s.Segments {
				if seg.Shm == "" {
					continue
				}
				require.True(t, strings.HasPrefix(seg.Shm, id+"-") || strings.HasPrefix(seg.Shm, id+"."),
					"%s mapped %q", id, seg.Shm)
				require.True(t, owned[seg.Shm], "%s mapped %q, not a regular one-link file of its own", id, seg.Shm)
			}
		}
		require.True(t, bytes.Equal(vicWant, vicSeg.Bytes()), "the victim's memory changed")
		got, err := os.ReadFile(outside)
		require.NoError(t, err)
		require.True(t, bytes.Equal(secret, got), "the file outside changed")
		var st node.StatusReply
		require.NoError(t, json.Unmarshal(request(t, "kvactors.vic.status", []byte(`{}`)), &st))
		require.Empty(t, st.Error, "the victim stays registered and answers")
	})
}
