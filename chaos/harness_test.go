//go:build chaos

package chaos_test

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
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

var long = flag.Bool("chaos.long", false, "run the long versions of the chaos tests")

// kvactorsBin and flooderBin are built once for the package, without -race.
var kvactorsBin, flooderBin string

func TestMain(m *testing.M) {
	flag.Parse()
	dir, err := os.MkdirTemp("", "kvactors-chaos-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	kvactorsBin, flooderBin = filepath.Join(dir, "kvactors"), filepath.Join(dir, "flooder")
	for bin, pkg := range map[string]string{kvactorsBin: "./cmd/kvactors", flooderBin: "./chaos/flooder"} {
		build := exec.Command("go", "build", "-o", bin, "github.com/kvactors/kvactors/"+strings.TrimPrefix(pkg, "./"))
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			fmt.Fprintln(os.Stderr, "build", pkg+":", err)
			os.Exit(1)
		}
	}
	code := m.Run()
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// proc is one `kvactors serve` child process.
type proc struct {
	cmd  *exec.Cmd
	out  *testkit.SyncBuffer
	done chan struct{}
	err  error
}

// serve starts `kvactors serve` with the given flags, never on default
// ports (--http off unless given). It is killed at cleanup if still up.
func serve(t *testing.T, args ...string) *proc {
	t.Helper()
	has := func(f string) bool {
		for _, a := range args {
			if a == f || strings.HasPrefix(a, f+"=") {
				return true
			}
		}
		return false
	}
	if !has("--http") {
		args = append(args, "--http", "off")
	}
	p := &proc{out: &testkit.SyncBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(kvactorsBin, append([]string{"serve"}, args...)...)
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	require.NoError(t, p.cmd.Start())
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("kvactors serve %v output:\n%s", args, p.out.String())
		}
	})
	return p
}

// kill9 kills the node like a crash would and waits for it to be gone.
func (p *proc) kill9(t *testing.T) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(os.Kill))
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		t.Fatal("kvactors did not die after SIGKILL")
	}
}

// exitCode waits up to d for the process to exit and returns its code.
func (p *proc) exitCode(t *testing.T, d time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(d):
		t.Fatalf("kvactors still running after %v", d)
	}
	var ee *exec.ExitError
	if errors.As(p.err, &ee) {
		return ee.ExitCode()
	}
	require.NoError(t, p.err)
	return 0
}

// peakRSS is the child's VmHWM in bytes (its peak resident set).
func (p *proc) peakRSS(t *testing.T) int64 {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", p.cmd.Process.Pid))
	require.NoError(t, err)
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if rest, ok := strings.CutPrefix(s.Text(), "VmHWM:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			require.NoError(t, err)
			return kb << 10
		}
	}
	t.Fatal("no VmHWM in /proc status")
	return 0
}

// rig is one SDK-driven engine with one full-attention group, one block
// per chunk, 4 tokens per block and per hash, and its own shm segment:
// request i owns blocks [i*bpr+1, (i+1)*bpr], each filled with a pattern
// before the tokens that cover it are announced.
type rig struct {
	t      *testing.T
	id     string
	c      *client.Client
	seg    *shm.Segment
	bpr    int // blocks per request
	blockB int

	mu       sync.Mutex
	releases map[string][]client.Release
	relCh    chan client.Release
	stored   map[string]bool // keys
	storedCh chan struct{}   // a token per stored message, dropped when full
}

const tph = 4

// engineConn connects engine's client to url with the SDK's options (its
// own reply inbox, the only one the node answers it in) and closes it when
// the test ends.
func engineConn(t *testing.T, url, engine string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, append(client.Options(engine), nats.Name(t.Name()))...)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return nc
}

func newRig(t *testing.T, nc *nats.Conn, shmDir, id string, requests, bpr, blockBytes int, tweak ...func(*client.Config)) *rig {
	t.Helper()
	blocks := requests*bpr + 1
	seg, err := shm.Create(shmDir, id+"-kv", int64(blocks*blockBytes))
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Remove() })
	r := &rig{t: t, id: id, seg: seg, bpr: bpr, blockB: blockBytes, releases: map[string][]client.Release{},
		relCh: make(chan client.Release, 1<<16), stored: map[string]bool{},
		storedCh: make(chan struct{}, 1)}
	cfg := client.Config{Engine: id, Spec: messages.EngineSpec{TokensPerHash: tph, BlocksPerChunk: 1, NumGPUBlocks: blocks,
		Segments: []messages.Segment{seg.Spec()},
		Groups: []messages.GroupSpec{{Kind: messages.KindFull, TokensPerBlock: tph,
			Regions: []messages.Region{{BlockStride: int64(blockBytes), BlockBytes: int64(blockBytes)}}}}},
		OnReleased: func(rel client.Release) {
			r.mu.Lock()
			r.releases[rel.Request] = append(r.releases[rel.Request], rel)
			r.mu.Unlock()
			r.relCh <- rel
		},
		OnStored: func(s messages.Stored) {
			r.mu.Lock()
			for _, ch := range s.Chunks {
				r.stored[ch.Key] = true
			}
			r.mu.Unlock()
			select {
			case r.storedCh <- struct{}{}:
			default:
			}
		}}
	for _, f := range tweak {
		f(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r.c, err = client.Connect(ctx, nc, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.c.Close() })
	return r
}

func reqID(i int) string { return "r" + strconv.Itoa(i) }

// hash is block j's hash of request i (raw bytes).
func (r *rig) hash(i, j int) []byte {
	var b [16]byte
	binary.BigEndian.PutUint64(b[:8], uint64(i))
	binary.BigEndian.PutUint64(b[8:], uint64(j))
	h := sha256.Sum256(append([]byte(r.id), b[:]...))
	return h[:]
}

func (r *rig) hashesHex(i int) []string {
	out := make([]string, r.bpr)
	for j := range out {
		out[j] = hex.EncodeToString(r.hash(i, j))
	}
	return out
}

// start announces request i fully computed (fill, then announce). The
// caller flushes.
func (r *rig) start(i int) {
	r.fill(i)
	r.announce(i)
}

// blockIDs are request i's block ids.
func (r *rig) blockIDs(i int) []uint32 {
	ids := make([]uint32, r.bpr)
	for j := range ids {
		ids[j] = uint32(i*r.bpr + j + 1)
	}
	return ids
}

// fill writes request i's blocks: each its hash, repeated.
func (r *rig) fill(i int) {
	mem := r.seg.Bytes()
	for j, id := range r.blockIDs(i) {
		blk := mem[int(id)*r.blockB : (int(id)+1)*r.blockB]
		n := copy(blk, r.hash(i, j))
		for n < len(blk) {
			n += copy(blk[n:], blk[:n])
		}
	}
}

// announce tells the node request i is fully computed: added, blocks,
// hashes, tokens.
func (r *rig) announce(i int) {
	id := reqID(i)
	hs := make([][]byte, r.bpr)
	for j := range hs {
		hs[j] = r.hash(i, j)
	}
	r.c.Added(id, r.bpr*tph)
	r.c.Blocks(id, 0, 0, r.blockIDs(i))
	r.c.Hashes(id, 0, hs...)
	r.c.Tokens(id, r.bpr*tph, r.bpr*tph)
}

func (r *rig) finish(i int) { r.c.Finished(reqID(i), false, r.bpr*tph, r.bpr*tph) }

func (r *rig) flush() { require.NoError(r.t, r.c.Flush()) }

// releasesOf returns a copy of request i's releases.
func (r *rig) releasesOf(i int) []client.Release {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]client.Release(nil), r.releases[reqID(i)]...)
}

// released counts requests in [from, to) with exactly one release, and
// fails the test on a second.
func (r *rig) released(from, to int) int {
	n := 0
	for i := from; i < to; i++ {
		switch rs := r.releasesOf(i); len(rs) {
		case 0:
		case 1:
			n++
		default:
			r.t.Fatalf("request %s released %d times: %+v", reqID(i), len(rs), rs)
		}
	}
	return n
}

// allLoadable reports how many of requests [from, to) the node can load in
// full (every chunk stored and ready).
func (r *rig) allLoadable(from, to int) (int, error) {
	n := 0
	for i := from; i < to; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		hit, err := r.c.Lookup(ctx, r.hashesHex(i))
		cancel()
		if err != nil {
			return n, err
		}
		if hit == r.bpr*tph {
			n++
		}
	}
	return n, nil
}

// metricSum scrapes the node's /metrics (it must run with --http
// 127.0.0.1:0) and sums every sample of the metric name, labels ignored.
func (p *proc) metricSum(t *testing.T, name string) float64 {
	t.Helper()
	var addr string
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		m := regexp.MustCompile(`admin http (\S+)`).FindStringSubmatch(p.out.String())
		if m == nil {
			return errors.New("the node has not printed its admin address")
		}
		addr = m[1]
		return nil
	})
	resp, err := http.Get("http://" + addr + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	sum := 0.0
	s := bufio.NewScanner(resp.Body)
	s.Buffer(nil, 1<<20)
	for s.Scan() {
		line := s.Text()
		if !strings.HasPrefix(line, name+" ") && !strings.HasPrefix(line, name+"{") {
			continue
		}
		v, err := strconv.ParseFloat(line[strings.LastIndexByte(line, ' ')+1:], 64)
		require.NoError(t, err, "metric line %q", line)
		sum += v
	}
	require.NoError(t, s.Err())
	return sum
}

// simNode starts an in-process node (its embedded NATS, a 2 s lease, shm in
// dir) for a sim run of engine "sim", and dials it as that engine.
func simNode(t *testing.T) (dir string, nc *nats.Conn) {
	t.Helper()
	dir = t.TempDir()
	n, err := node.Start(context.Background(), node.Config{NATSPort: -1, NATSStoreDir: t.TempDir(), ShmDir: dir,
		PoolBytes: 256 << 20, HTTPAddr: node.HTTPOff, Log: quietLog(), Registry: prometheus.NewRegistry(),
		Lease: 2 * time.Second})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	nc, err = client.Dial(n.NATSURL(), "sim")
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	return dir, nc
}
