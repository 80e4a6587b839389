//go:build cuda

package node_test

// End to end on the CUDA backend: a node with Backend "cuda" stores an
// engine's KV blocks out of real device memory and loads them back, and the
// engine compares the device bytes. The engine is a child process (this test
// binary re-executed with cudaEngineEnv set): CUDA refuses to open an IPC
// handle in the process that exported it, so a same-process engine would not
// exercise cuIpcOpenMemHandle. The child allocates its KV cache with
// cuMemAlloc (cuda.Backend.AllocDevice), exports IPC handles, writes a byte
// pattern per block host→device, registers over NATS, publishes batches
// with hashes lagging behind tokens, waits for the stores, asks for a load
// into other blocks, reads its whole KV cache back device→host and compares
// every byte with what it expects. It prints a verdict line; the parent
// asserts on stored and released as seen on NATS and on that verdict.
//
// These need a GPU (gorgonia.org/cu's init exits without one) or the fake
// driver of scripts/cuda-check (backend/cuda/testdata/fakecuda.c), which
// runs them with -race; scripts/gpu-check runs them on a GPU machine, the
// second one against a `kvactors serve --backend cuda` binary.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"gorgonia.org/cu"

	"github.com/kvactors/kvactors/backend/backendtest"
	"github.com/kvactors/kvactors/backend/cuda"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

const (
	// cudaEngineEnv set to a NATS URL makes this binary the engine child.
	cudaEngineEnv = "KVACTORS_E2E_CUDA_ENGINE"
	// cudaEngineIDEnv names the child's engine id.
	cudaEngineIDEnv = "KVACTORS_E2E_CUDA_ENGINE_ID"
	// cudaDeviceEnv is the device ordinal of node and engine (default 0).
	cudaDeviceEnv = "KVACTORS_E2E_CUDA_DEVICE"
	// cudaServeEnv is the path of a kvactors binary built with -tags cuda;
	// TestCUDAServeBinary runs the scenario against it (skipped when unset).
	cudaServeEnv = "KVACTORS_E2E_SERVE"
	// cudaE2ELimit bounds every wait of the parent on the child and the
	// child's wait for the whole scenario.
	cudaE2ELimit = 60 * time.Second
	// cudaStepLimit bounds each of the child's waits for the node.
	cudaStepLimit = 20 * time.Second
	verdictPrefix = "KVACTORS-E2E-VERDICT "
)

// The engine's layout: two full-attention groups of two layers each, 4
// blocks per chunk, 64 KiB per block and layer, in three cuMemAlloc
// segments (three IPC handles). A chunk's host copy is its blocks in order,
// each block its layers in order (PROTOCOL.md), so:
//   - group 0 keeps both layers in segment 0, interleaved per block (layer l
//     of block b at cell 2b+l): a chunk of adjacent blocks is contiguous on
//     the device and in the pool, and the backend merges it into one 512 KiB
//     copy;
//   - group 1 keeps one tensor per layer, as vLLM does (layer l in segment
//     1+l, block b at cell b): a chunk is 8 copies of 64 KiB, none mergeable.
//
// Request r1 has 4 chunks per group.
const (
	e2eTPH        = 16
	e2eTPB        = 16
	e2eBPC        = 4
	e2eBlocks     = 64
	e2eBlockBytes = 64 << 10
	e2eGroups     = 2
	e2eLayers     = 2
	e2eChunks     = 4
	e2eTokensPC   = e2eTPB * e2eBPC         // tokens per chunk
	e2eHashesPC   = e2eTokensPC / e2eTPH    // hashes per chunk
	e2eTokens     = e2eChunks * e2eTokensPC // r1's tokens
	e2eHashes     = e2eChunks * e2eHashesPC // r1's hashes
	e2eSegments   = 3
	e2eChunkBytes = e2eBPC * e2eLayers * e2eBlockBytes
	e2eLagChunks  = 2 // chunks whose hashes the first batch carries
)

// e2eSource are r1's blocks per group, e2eTarget where r2 loads them. Group
// 0 runs forward (a chunk's blocks are adjacent: one DMA per chunk), group 1
// backward and scattered.
var e2eSource, e2eTarget = func() ([e2eGroups][]int, [e2eGroups][]int) {
	var src, dst [e2eGroups][]int
	n := e2eChunks * e2eBPC
	for i := range n {
		src[0] = append(src[0], 1+i)
		dst[0] = append(dst[0], 41+i)
		src[1] = append(src[1], 32-i)
		dst[1] = append(dst[1], 33+(i*5)%n)
	}
	return src, dst
}()

func e2eHashList() []string {
	hs := make([]string, e2eHashes)
	for i := range hs {
		hs[i] = hash("cuda", i)
	}
	return hs
}

// e2eKey is the offload key of chunk c of group g (PROTOCOL.md).
func e2eKey(hs []string, g, c int) string {
	var gb [4]byte
	binary.BigEndian.PutUint32(gb[:], uint32(g))
	return hs[(c+1)*e2eHashesPC-1] + hex.EncodeToString(gb[:])
}

// e2eSegBytes is the size of segment s.
func e2eSegBytes(s int) int {
	if s == 0 {
		return e2eBlocks * e2eLayers * e2eBlockBytes
	}
	return e2eBlocks * e2eBlockBytes
}

// e2eCell is where layer l of block b of group g lives: segment and cell
// (a cell is e2eBlockBytes).
func e2eCell(g, l, b int) (seg, cell int) {
	if g == 0 {
		return 0, b*e2eLayers + l
	}
	return 1 + l, b
}

// e2eWhat names the group, block and layer at a segment offset.
func e2eWhat(seg, off int) string {
	cell := off / e2eBlockBytes
	if seg == 0 {
		return fmt.Sprintf("group 0 block %d layer %d", cell/e2eLayers, cell%e2eLayers)
	}
	return fmt.Sprintf("group 1 block %d layer %d", cell, seg-1)
}

// e2ePattern fills p, cell c of segment s, with bytes that name both, so a
// block copied to the wrong place shows.
func e2ePattern(p []byte, s, c int) {
	x := uint64(s)<<48 | uint64(c)<<24 | 0x9e3779b9
	for i := 0; i+8 <= len(p); i += 8 {
		x += 0x9e3779b97f4a7c15 // splitmix64
		z := x
		z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
		z = (z ^ z>>27) * 0x94d049bb133111eb
		binary.LittleEndian.PutUint64(p[i:], z^z>>31)
	}
}

// e2eSegment is segment s's initial contents: every cell its own pattern.
func e2eSegment(s int) []byte {
	p := make([]byte, e2eSegBytes(s))
	for c := range len(p) / e2eBlockBytes {
		e2ePattern(p[c*e2eBlockBytes:(c+1)*e2eBlockBytes], s, c)
	}
	return p
}

func e2eDevice() int {
	d, _ := strconv.Atoi(os.Getenv(cudaDeviceEnv))
	return d
}

// e2eVerdict is the child's last word.
type e2eVerdict struct {
	OK           bool   `json:"ok"`
	Error        string `json:"error,omitempty"`
	CheckedBytes int64  `json:"checked_bytes"`
	StoredJobs   int    `json:"stored_jobs"`
	LagHitTokens int    `json:"lag_hit_tokens"`
	HitTokens    int    `json:"hit_tokens"`
	LoadedTokens int    `json:"loaded_tokens"`
	Millis       int64  `json:"millis"`
}

// init runs the child before the tests start (a TestMain here would clash
// with one the untagged tests of this package may get).
func init() {
	if url := os.Getenv(cudaEngineEnv); url != "" {
		os.Exit(cudaEngineMain(url, os.Getenv(cudaEngineIDEnv)))
	}
}

// cudaEngineMain is the child: it plays the engine, prints the verdict,
// then keeps its device memory until stdin closes (the parent closes it once
// the node has unmapped the IPC handles) and exits 0 after a passing run.
func cudaEngineMain(url, id string) int {
	logf := func(format string, a ...any) {
		fmt.Fprintf(os.Stderr, "cuda engine %s: "+format+"\n", append([]any{id}, a...)...)
	}
	start := time.Now()
	v, cleanup, err := cudaEngineRun(url, id, logf)
	if err != nil {
		v.Error = err.Error()
	}
	v.OK = err == nil
	v.Millis = time.Since(start).Milliseconds()
	line, _ := json.Marshal(v)
	fmt.Printf("%s%s\n", verdictPrefix, line)
	_, _ = io.Copy(io.Discard, os.Stdin)
	if cleanup != nil {
		if err := cleanup(); err != nil {
			logf("cleanup: %v", err)
			return 1
		}
	}
	if !v.OK {
		logf("FAILED: %s", v.Error)
		return 1
	}
	return 0
}

func cudaEngineRun(url, id string, logf func(string, ...any)) (v e2eVerdict, cleanup func() error, err error) {
	b, err := cuda.Open(cuda.Config{Device: e2eDevice()})
	if err != nil {
		return v, nil, err
	}
	var bufs []*cuda.DeviceBuffer
	cleanup = func() error {
		var errs []error
		for _, buf := range bufs {
			errs = append(errs, buf.Free())
		}
		return errors.Join(append(errs, b.Close())...)
	}
	spec := messages.EngineSpec{TokensPerHash: e2eTPH, BlocksPerChunk: e2eBPC, NumGPUBlocks: e2eBlocks}
	want := make([][]byte, e2eSegments)
	for s := range e2eSegments {
		buf, err := b.AllocDevice(int64(e2eSegBytes(s)))
		if err != nil {
			return v, cleanup, err
		}
		bufs = append(bufs, buf)
		spec.Segments = append(spec.Segments, buf.Segment())
		want[s] = e2eSegment(s)
		if err := buf.Write(0, want[s]); err != nil { // host→device
			return v, cleanup, err
		}
	}
	for g := range e2eGroups {
		gs := messages.GroupSpec{Kind: messages.KindFull, TokensPerBlock: e2eTPB}
		for l := range e2eLayers {
			seg, cell := e2eCell(g, l, 0)
			_, next := e2eCell(g, l, 1)
			gs.Regions = append(gs.Regions, messages.Region{Segment: seg, Offset: int64(cell) * e2eBlockBytes,
				BlockStride: int64(next-cell) * e2eBlockBytes, BlockBytes: e2eBlockBytes})
		}
		spec.Groups = append(spec.Groups, gs)
	}
	logf("allocated %d segments (%d, %d, %d bytes), patterns written", e2eSegments, e2eSegBytes(0), e2eSegBytes(1), e2eSegBytes(2))

	nc, err := nats.Connect(url, nats.Name("cuda-e2e-engine"),
		nats.CustomInboxPrefix(messages.InboxRoot+id)) // the node answers an engine only there
	if err != nil {
		return v, cleanup, err
	}
	defer nc.Close()
	subject := func(verb string) string { return "kvactors." + id + "." + verb }
	stored := make(chan messages.Stored, 64)
	released := make(chan messages.Released, 64)
	for verb, fn := range map[string]nats.MsgHandler{
		"stored": func(m *nats.Msg) {
			var s messages.Stored
			if json.Unmarshal(m.Data, &s) == nil {
				stored <- s
			}
		},
		"released": func(m *nats.Msg) {
			var r messages.Released
			if json.Unmarshal(m.Data, &r) == nil {
				released <- r
			}
		},
	} {
		if _, err := nc.Subscribe(subject(verb), fn); err != nil {
			return v, cleanup, err
		}
	}
	if err := nc.Flush(); err != nil {
		return v, cleanup, err
	}
	request := func(verb string, body, reply any) error {
		data, err := json.Marshal(body)
		if err != nil {
			return err
		}
		m, err := nc.Request(subject(verb), data, cudaStepLimit)
		if err != nil {
			return fmt.Errorf("%s: %w", verb, err)
		}
		if err := json.Unmarshal(m.Data, reply); err != nil {
			return fmt.Errorf("%s reply %q: %w", verb, m.Data, err)
		}
		return nil
	}
	var seq uint64
	send := func(events ...map[string]any) error {
		seq++
		data, err := json.Marshal(map[string]any{"epoch": "cuda-e2e", "seq": seq, "events": events})
		if err != nil {
			return err
		}
		if err := nc.Publish(subject("events"), data); err != nil {
			return err
		}
		return nc.Flush()
	}
	// awaitStored collects stored jobs until every chunk index in [from, to)
	// of every group arrived; any other chunk is an error.
	awaitStored := func(from, to int) error {
		missing := map[[2]int]bool{}
		for g := range e2eGroups {
			for c := from; c < to; c++ {
				missing[[2]int{g, c}] = true
			}
		}
		deadline := time.After(cudaStepLimit)
		for len(missing) > 0 {
			select {
			case s := <-stored:
				v.StoredJobs++
				for _, c := range s.Chunks {
					k := [2]int{c.Group, c.Index}
					if !missing[k] {
						return fmt.Errorf("stored chunk %d of group %d unexpectedly (want [%d, %d))", c.Index, c.Group, from, to)
					}
					delete(missing, k)
				}
			case <-deadline:
				return fmt.Errorf("no stored job for chunks %v within %v", missing, cudaStepLimit)
			}
		}
		return nil
	}
	lookup := func(hs []string) (int, error) {
		var r messages.LookupReply
		if err := request("lookup", map[string]any{"hashes": hs}, &r); err != nil {
			return 0, err
		}
		if r.Error != "" {
			return 0, fmt.Errorf("lookup: %s", r.Error)
		}
		return r.HitTokens, nil
	}

	var reg messages.RegisterReply
	if err := request("register", spec, &reg); err != nil {
		return v, cleanup, err
	}
	if !reg.OK {
		return v, cleanup, fmt.Errorf("register refused: %s", reg.Error)
	}
	logf("registered")

	// Batch 1: every block and token of r1, but hashes of the first chunks
	// only: the other chunks are deferred until their hashes arrive.
	hs := e2eHashList()
	if err := send(
		map[string]any{"type": "added", "request": "r1", "prompt_tokens": e2eTokens},
		map[string]any{"type": "blocks", "request": "r1", "group": 0, "start": 0, "ids": e2eSource[0]},
		map[string]any{"type": "blocks", "request": "r1", "group": 1, "start": 0, "ids": e2eSource[1]},
		map[string]any{"type": "hashes", "request": "r1", "start": 0, "hashes": hs[:e2eLagChunks*e2eHashesPC]},
		map[string]any{"type": "tokens", "request": "r1", "computed": e2eTokens, "total": e2eTokens},
	); err != nil {
		return v, cleanup, err
	}
	if err := awaitStored(0, e2eLagChunks); err != nil {
		return v, cleanup, err
	}
	if v.LagHitTokens, err = lookup(hs); err != nil {
		return v, cleanup, err
	}
	if v.LagHitTokens != e2eLagChunks*e2eTokensPC {
		return v, cleanup, fmt.Errorf("lookup while hashes lag: %d hit tokens, want %d", v.LagHitTokens, e2eLagChunks*e2eTokensPC)
	}
	logf("chunks [0, %d) stored while hashes lag", e2eLagChunks)

	// Batch 2: the missing hashes; the deferred chunks are stored now.
	if err := send(map[string]any{"type": "hashes", "request": "r1", "start": e2eLagChunks * e2eHashesPC,
		"hashes": hs[e2eLagChunks*e2eHashesPC:]}); err != nil {
		return v, cleanup, err
	}
	if err := awaitStored(e2eLagChunks, e2eChunks); err != nil {
		return v, cleanup, err
	}
	if v.HitTokens, err = lookup(hs); err != nil {
		return v, cleanup, err
	}
	if v.HitTokens != e2eTokens {
		return v, cleanup, fmt.Errorf("lookup: %d hit tokens, want %d", v.HitTokens, e2eTokens)
	}
	logf("all %d chunks per group stored", e2eChunks)

	// Load everything into the target blocks (host→device), then read the
	// whole KV cache back (device→host) and compare every byte: targets must
	// hold their sources' bytes, every other block its own pattern.
	var lr messages.LoadReply
	if err := request("load", map[string]any{"request": "r2", "hashes": hs, "num_tokens": e2eTokens,
		"blocks": [][]int{e2eTarget[0], e2eTarget[1]}}, &lr); err != nil {
		return v, cleanup, err
	}
	if !lr.OK || lr.LoadedTokens != e2eTokens {
		return v, cleanup, fmt.Errorf("load: ok=%v loaded_tokens=%d error=%q, want %d tokens", lr.OK, lr.LoadedTokens, lr.Error, e2eTokens)
	}
	for g := range e2eGroups {
		for i, src := range e2eSource[g] {
			for l := range e2eLayers {
				ss, sc := e2eCell(g, l, src)
				ds, dc := e2eCell(g, l, e2eTarget[g][i])
				copy(want[ds][dc*e2eBlockBytes:(dc+1)*e2eBlockBytes], want[ss][sc*e2eBlockBytes:(sc+1)*e2eBlockBytes])
			}
		}
	}
	for s := range e2eSegments {
		got := make([]byte, e2eSegBytes(s))
		if err := bufs[s].Read(0, got); err != nil { // device→host
			return v, cleanup, err
		}
		if err := e2eCompare(s, want[s], got); err != nil {
			return v, cleanup, err
		}
		v.CheckedBytes += int64(len(got))
	}
	v.LoadedTokens = lr.LoadedTokens
	logf("loaded %d tokens; %d device bytes verified", lr.LoadedTokens, v.CheckedBytes)

	if err := send(map[string]any{"type": "finished", "request": "r1", "aborted": false,
		"computed": e2eTokens, "total": e2eTokens}); err != nil {
		return v, cleanup, err
	}
	select {
	case r := <-released:
		// v2: released names the epoch it belongs to and a per-epoch rseq.
		if r.Request != "r1" || r.Reason != messages.ReasonFinished || r.Epoch != "cuda-e2e" || r.RSeq < 1 {
			return v, cleanup, fmt.Errorf("released %+v, want r1 finished in epoch cuda-e2e", r)
		}
	case <-time.After(cudaStepLimit):
		return v, cleanup, fmt.Errorf("no released for r1 within %v", cudaStepLimit)
	}
	return v, cleanup, nil
}

// e2eCompare names the first differing block and how many bytes differ.
func e2eCompare(seg int, want, got []byte) error {
	if bytes.Equal(want, got) {
		return nil
	}
	first, n := backendtest.Diff(want, got)
	return fmt.Errorf("segment %d: %d bytes differ, first at offset %d (%s)", seg, n, first, e2eWhat(seg, first))
}

// cudaEngine is the parent's handle on the child.
type cudaEngine struct {
	t       *testing.T
	cmd     *exec.Cmd
	stdin   io.WriteCloser
	verdict chan e2eVerdict // closed without a value when stdout ends first
	once    sync.Once
	exitErr error
}

func startCUDAEngine(t *testing.T, url, id string) *cudaEngine {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), cudaEngineEnv+"="+url, cudaEngineIDEnv+"="+id,
		cudaDeviceEnv+"="+strconv.Itoa(e2eDevice()))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	e := &cudaEngine{t: t, cmd: cmd, stdin: stdin, verdict: make(chan e2eVerdict, 1)}
	go func() {
		defer close(e.verdict)
		s := bufio.NewScanner(stdout)
		for s.Scan() {
			line, ok := strings.CutPrefix(s.Text(), verdictPrefix)
			if !ok {
				continue
			}
			var v e2eVerdict
			if err := json.Unmarshal([]byte(line), &v); err != nil {
				v.Error = fmt.Sprintf("bad verdict %q: %v", line, err)
			}
			e.verdict <- v
			_, _ = io.Copy(io.Discard, stdout)
			return
		}
	}()
	t.Cleanup(func() {
		if e.stop() != nil {
			_ = cmd.Process.Kill()
		}
	})
	return e
}

// wait returns the child's verdict.
func (e *cudaEngine) wait() e2eVerdict {
	e.t.Helper()
	select {
	case v, ok := <-e.verdict:
		require.True(e.t, ok, "the engine child exited without a verdict (its stderr is above)")
		return v
	case <-time.After(cudaE2ELimit):
		_ = e.cmd.Process.Kill()
		require.FailNow(e.t, "timed out", "waited %v for the engine child's verdict", cudaE2ELimit)
		return e2eVerdict{}
	}
}

// stop closes the child's stdin, which makes it free its device memory and
// exit, and returns how it exited. Call it after the node closed its
// mappings of that memory.
func (e *cudaEngine) stop() error {
	e.once.Do(func() {
		_ = e.stdin.Close()
		done := make(chan error, 1)
		go func() { done <- e.cmd.Wait() }()
		select {
		case e.exitErr = <-done:
		case <-time.After(cudaE2ELimit):
			_ = e.cmd.Process.Kill()
			e.exitErr = fmt.Errorf("engine child did not exit within %v", cudaE2ELimit)
		}
	})
	return e.exitErr
}

// cudaScenario runs the child engine id against the node at url and checks
// what the node published; closeNode stops the node before the child frees
// the memory the node has mapped.
func cudaScenario(t *testing.T, url, id string, closeNode func()) e2eVerdict {
	nc, err := nats.Connect(url)
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	stored := make(chan messages.Stored, 64)
	released := make(chan messages.Released, 64)
	subscribeJSON(t, nc, "kvactors."+id+".stored", stored)
	subscribeJSON(t, nc, "kvactors."+id+".released", released)
	require.NoError(t, nc.Flush())

	eng := startCUDAEngine(t, url, id)
	v := eng.wait()
	require.True(t, v.OK, "engine child: %s", v.Error)
	t.Logf("engine child verdict: %+v", v)
	require.EqualValues(t, e2eSegBytes(0)+e2eSegBytes(1)+e2eSegBytes(2), v.CheckedBytes)

	// Stored, as the node published it: every chunk once, with its key, the
	// lagging chunks after the others, and the bytes of the chunks.
	hs := e2eHashList()
	seen := map[[2]int]bool{}
	var total int64
	jobs := 0
	for len(seen) < e2eGroups*e2eChunks {
		s := recv(t, stored, "stored")
		jobs++
		require.Equal(t, "r1", s.Request)
		require.EqualValues(t, int64(len(s.Chunks))*e2eChunkBytes, s.Bytes, "bytes of stored job %d", s.Job)
		total += s.Bytes
		for _, c := range s.Chunks {
			k := [2]int{c.Group, c.Index}
			require.False(t, seen[k], "chunk %d of group %d stored twice", c.Index, c.Group)
			seen[k] = true
			require.Equal(t, e2eKey(hs, c.Group, c.Index), c.Key)
			if c.Index >= e2eLagChunks {
				for g := range e2eGroups {
					for i := range e2eLagChunks {
						require.True(t, seen[[2]int{g, i}], "chunk %d stored before chunk %d of group %d, whose hashes came first", c.Index, i, g)
					}
				}
			}
		}
	}
	require.Equal(t, v.StoredJobs, jobs)
	require.EqualValues(t, e2eGroups*e2eChunks*e2eChunkBytes, total)
	require.Equal(t, messages.Released{Request: "r1", Epoch: "cuda-e2e", RSeq: 1, Reason: messages.ReasonFinished},
		recv(t, released, "released"), "v2: released names its epoch and per-epoch rseq")

	closeNode()
	require.NoError(t, eng.stop(), "engine child exit")
	select {
	case s := <-stored:
		t.Fatalf("unexpected stored %+v", s)
	case r := <-released:
		t.Fatalf("unexpected released %+v", r)
	default:
	}
	return v
}

// TestCUDAEndToEnd: a node started in this process with the cuda backend.
func TestCUDAEndToEnd(t *testing.T) {
	n, err := node.Start(context.Background(), node.Config{Backend: cuda.Name, CUDADevice: e2eDevice(),
		NATSPort: -1, NATSStoreDir: t.TempDir(), PoolBytes: 16 << 20, HTTPAddr: node.HTTPOff,
		Registry: prometheus.NewRegistry(), Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	require.NoError(t, n.Ready(), "readiness includes the backend's health")
	cudaScenario(t, n.NATSURL(), "cuda-e2e", func() {
		require.NoError(t, n.Ready(), "backend still healthy after the copies")
		require.NoError(t, n.Close(context.Background()))
	})
	// The node's Close closes the backend too: its context reference
	// (with its streams and locked threads) is released.
	device, err := cu.GetDevice(e2eDevice())
	require.NoError(t, err)
	_, active, err := device.PrimaryCtxState()
	require.NoError(t, err)
	require.Zero(t, active, "the primary context is still retained after the node closed")
}

// TestCUDAServeBinary: the same against `kvactors serve --backend cuda`,
// the binary a deployment runs, with /readyz checked before and after.
func TestCUDAServeBinary(t *testing.T) {
	bin := os.Getenv(cudaServeEnv)
	if bin == "" {
		t.Skipf("set %s to a kvactors binary built with -tags cuda (scripts/gpu-check does)", cudaServeEnv)
	}
	cmd := exec.Command(bin, "serve", "--backend", "cuda", "--cuda-device", strconv.Itoa(e2eDevice()),
		"--nats-port", "-1", "--nats-store-dir", t.TempDir(), "--http", "127.0.0.1:0",
		"--pool-bytes", "16M", "--log-level", "warn")
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	var waitErr error
	exited := make(chan struct{}) // closed once Wait returned waitErr
	go func() { waitErr = cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		select {
		case <-exited:
		default:
			_ = cmd.Process.Kill()
			<-exited
		}
	})
	lines := make(chan string, 1)
	go func() {
		s := bufio.NewScanner(stdout)
		for s.Scan() {
			if strings.HasPrefix(s.Text(), "kvactors serving") {
				lines <- s.Text()
			}
		}
		close(lines)
	}()
	var serving string
	select {
	case serving = <-lines:
	case <-exited:
		t.Fatalf("kvactors serve exited before serving: %v", waitErr)
	case <-time.After(cudaE2ELimit):
		t.Fatalf("kvactors serve did not print its URL within %v", cudaE2ELimit)
	}
	m := regexp.MustCompile(`nats (nats://\S+),.*admin http (\S+)`).FindStringSubmatch(serving)
	require.Len(t, m, 3, serving)
	readyz := func() int {
		resp, err := http.Get("http://" + m[2] + "/readyz")
		require.NoError(t, err)
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		return resp.StatusCode
	}
	require.Equal(t, http.StatusOK, readyz(), "/readyz before")
	cudaScenario(t, m[1], "cuda-serve", func() {
		require.Equal(t, http.StatusOK, readyz(), "/readyz after the copies")
		require.NoError(t, cmd.Process.Signal(syscall.SIGTERM))
		select {
		case <-exited:
			require.NoError(t, waitErr, "kvactors serve exits 0 after SIGTERM")
		case <-time.After(cudaE2ELimit):
			t.Fatalf("kvactors serve did not exit within %v of SIGTERM", cudaE2ELimit)
		}
	})
}
