package main

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// Issue 12: `kvactors serve --disk-dir` killed with SIGKILL while it spills
// evicted chunks to disk; a node started on the same directory rebuilds the
// index, and every chunk it lists loads back byte-identical to the block it
// was stored from (none half-written is served), including every chunk the
// killed node had announced as stored on disk.
func TestServeDiskTierSurvivesKill9(t *testing.T) {
	dir, diskDir := t.TempDir(), t.TempDir()
	const blocks, blockBytes = 512, 256
	seg, err := shm.Create(dir, "cli-disk", blocks*blockBytes)
	require.NoError(t, err)
	defer seg.Close()
	pattern := func(b int) []byte {
		p := make([]byte, blockBytes)
		for i := range p {
			p[i] = byte(b*13 + i*7 + i/97)
		}
		return p
	}
	for b := range blocks {
		copy(seg.Bytes()[b*blockBytes:], pattern(b))
	}
	spec := messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: blocks,
		Segments: []messages.Segment{seg.Spec()}, Groups: []messages.GroupSpec{{Kind: "full", TokensPerBlock: 4,
			Regions: []messages.Region{{BlockStride: blockBytes, BlockBytes: blockBytes}}}}}
	specBody, _ := json.Marshal(spec)
	hash := func(i int) string { return hex.EncodeToString([]byte(fmt.Sprintf("k%07d", i))) }
	block := func(i int) int { return 1 + i%400 } // chunk i is stored from this block

	cmd := exec.Command(binary, "serve", "--nats-port", "-1", "--http", "off", "--shm-dir", dir,
		"--pool-bytes", "16K", "--disk-dir", diskDir, "--disk-bytes", "64M", "--log-level", "error")
	cmd.Env = os.Environ()
	serving, _ := startServe(t, cmd)
	nc, err := nats.Connect(servingURL(t, serving), client.Options("cli")...)
	require.NoError(t, err)
	defer nc.Close()
	reply, err := nc.Request("kvactors.cli.register", specBody, 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), `"ok":true`)

	var mu sync.Mutex
	announced := map[string]bool{} // hashes the killed node announced as on disk
	sub, err := nc.Subscribe("kvactors.cli.kv_events", func(msg *nats.Msg) {
		var b messages.KVEventBatch
		if json.Unmarshal(msg.Data, &b) != nil {
			return
		}
		mu.Lock()
		defer mu.Unlock()
		for _, ev := range b.Events {
			if ev.Medium == messages.MediumDisk && ev.Type == messages.KVBlockStored {
				for _, h := range ev.BlockHashes {
					announced[h] = true
				}
			}
		}
	})
	require.NoError(t, err)
	defer sub.Unsubscribe()
	onDisk := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(announced)
	}

	// A stream of one-chunk requests through a 64-chunk pool: every chunk
	// past the first 64 evicts one, which is spilled. Kill once 300 spills
	// were announced, while the stream (and the spilling) goes on.
	stop := make(chan struct{})
	published := make(chan int, 1)
	go func() {
		i := 0
		defer func() { published <- i }()
		for ; i < 20000; i++ {
			select {
			case <-stop:
				return
			default:
			}
			r := fmt.Sprintf("r%d", i)
			body := fmt.Sprintf(`{"epoch":"e","seq":%d,"events":[{"type":"added","request":%q,"prompt_tokens":4},`+
				`{"type":"hashes","request":%q,"start":0,"hashes":[%q]},{"type":"blocks","request":%q,"group":0,"start":0,"ids":[%d]},`+
				`{"type":"tokens","request":%q,"computed":4,"total":4},{"type":"finished","request":%q,"computed":4,"total":4}]}`,
				i+1, r, r, hash(i), r, block(i), r, r)
			if nc.Publish("kvactors.cli.events", []byte(body)) != nil {
				return
			}
			if i%50 == 49 {
				_ = nc.Flush()
			}
		}
	}()
	testkit.Eventually(t, 30*time.Second, 5*time.Millisecond, func() error {
		if n := onDisk(); n < 300 {
			return fmt.Errorf("%d chunks announced on disk", n)
		}
		return nil
	})
	require.NoError(t, cmd.Process.Signal(syscall.SIGKILL))
	_ = cmd.Wait()
	close(stop)
	nc.Close() // its server died with the node: a Flush would wait out its timeout
	select {
	case n := <-published:
		t.Logf("published %d requests before the kill", n)
	case <-time.After(10 * time.Second):
		t.Fatal("publisher did not stop")
	}
	mu.Lock()
	before := make([]string, 0, len(announced))
	for h := range announced {
		before = append(before, h)
	}
	mu.Unlock()

	// Restart on the same disk directory (in process), same engine segment.
	n, err := node.Start(context.Background(), node.Config{NATSPort: -1, NATSStoreDir: t.TempDir(), ShmDir: dir,
		PoolBytes: 16 << 10, HTTPAddr: node.HTTPOff, DiskDir: diskDir, DiskBytes: 64 << 20,
		Registry: prometheus.NewRegistry(), Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	defer func() { _ = n.Close(context.Background()) }()
	nc2, err := nats.Connect(n.NATSURL(), client.Options("cli")...)
	require.NoError(t, err)
	defer nc2.Close()
	reply, err = nc2.Request("kvactors.cli.register", specBody, 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), `"ok":true`)
	keys := n.Disk().Keys()
	listed := map[string]bool{}
	for _, k := range keys { // a disk key ends with the offload key: the 8-byte hash, then group 0
		listed[hex.EncodeToString([]byte(k[len(k)-12:len(k)-4]))] = true
	}
	for _, h := range before {
		require.True(t, listed[h], "chunk %s was announced on disk before the kill", h)
	}
	const dst = 500
	for h := range listed {
		var i int
		raw, err := hex.DecodeString(h)
		require.NoError(t, err)
		_, err = fmt.Sscanf(string(raw), "k%07d", &i)
		require.NoError(t, err)
		copy(seg.Bytes()[dst*blockBytes:], make([]byte, blockBytes))
		body := fmt.Sprintf(`{"request":"v","hashes":[%q],"num_tokens":4,"blocks":[[%d]]}`, h, dst)
		msg, err := nc2.Request("kvactors.cli.load", []byte(body), 5*time.Second)
		require.NoError(t, err)
		var lr messages.LoadReply
		require.NoError(t, json.Unmarshal(msg.Data, &lr))
		require.True(t, lr.OK, "chunk %d: %s", i, lr.Error)
		require.Equal(t, pattern(block(i)), seg.Bytes()[dst*blockBytes:(dst+1)*blockBytes],
			"chunk %d loads back byte-identical", i)
	}
	t.Logf("%d chunks announced on disk before the kill, %d listed after the restart, all loaded byte-identical",
		len(before), len(listed))
}
