//go:build cuda

package cuda

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"gorgonia.org/cu"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/backend/backendtest"
	"github.com/kvactors/kvactors/messages"
)

// A CUDA IPC handle cannot be opened by the process that exported it, so the
// IPC tests run the engine side in a child: this test binary re-executed with
// engineEnv set, which allocates segments, prints their specs, and then
// serves writes and reads as JSON lines on stdin/stdout until stdin closes.
const (
	engineEnv   = "KVACTORS_CUDA_TEST_ENGINE" // comma-separated segment sizes
	deviceEnv   = "KVACTORS_CUDA_TEST_DEVICE" // device ordinal, default 0
	engineLimit = 60 * time.Second            // bounds every wait on the child
)

type engineReq struct {
	Op   string `json:"op"` // "write" or "read"
	Seg  int    `json:"seg"`
	Off  int64  `json:"off"`
	N    int64  `json:"n,omitempty"`
	Data []byte `json:"data,omitempty"`
}

type engineResp struct {
	Segments []messages.Segment `json:"segments,omitempty"`
	Data     []byte             `json:"data,omitempty"`
	Error    string             `json:"error,omitempty"`
}

func TestMain(m *testing.M) {
	if sizes := os.Getenv(engineEnv); sizes != "" {
		os.Exit(runEngine(sizes))
	}
	os.Exit(m.Run())
}

func testDevice() int {
	d, _ := strconv.Atoi(os.Getenv(deviceEnv))
	return d
}

// runEngine is the child: the engine side of the IPC tests.
func runEngine(sizeList string) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "engine:", err)
		return 1
	}
	b, err := Open(Config{Device: testDevice()})
	if err != nil {
		return fail(err)
	}
	defer b.Close()
	var bufs []*DeviceBuffer
	defer func() {
		for _, buf := range bufs {
			_ = buf.Free()
		}
	}()
	var specs []messages.Segment
	for _, f := range strings.Split(sizeList, ",") {
		n, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			return fail(err)
		}
		buf, err := b.AllocDevice(n)
		if err != nil {
			return fail(err)
		}
		bufs = append(bufs, buf)
		specs = append(specs, buf.Segment())
	}
	enc := json.NewEncoder(os.Stdout)
	if err := enc.Encode(engineResp{Segments: specs}); err != nil {
		return fail(err)
	}
	dec := json.NewDecoder(bufio.NewReader(os.Stdin))
	for {
		var req engineReq
		if err := dec.Decode(&req); err == io.EOF {
			return 0 // the parent is done: free and exit
		} else if err != nil {
			return fail(err)
		}
		var resp engineResp
		if req.Seg < 0 || req.Seg >= len(bufs) {
			resp.Error = fmt.Sprintf("segment %d of %d", req.Seg, len(bufs))
		} else if req.Op == "write" {
			err = bufs[req.Seg].Write(req.Off, req.Data)
		} else {
			resp.Data = make([]byte, req.N)
			err = bufs[req.Seg].Read(req.Off, resp.Data)
		}
		if err != nil {
			resp.Error = err.Error()
		}
		if err := enc.Encode(resp); err != nil {
			return fail(err)
		}
	}
}

// engineProc is the parent's handle on a child engine.
type engineProc struct {
	t     *testing.T
	cmd   *exec.Cmd
	stdin io.WriteCloser
	enc   *json.Encoder
	resps chan engineResp // closed when the child's stdout ends
	specs []messages.Segment
}

// startEngine runs a child engine with segments of sizes; t.Cleanup ends it.
func startEngine(t *testing.T, sizes []int64) *engineProc {
	t.Helper()
	var list []string
	for _, n := range sizes {
		list = append(list, strconv.FormatInt(n, 10))
	}
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), engineEnv+"="+strings.Join(list, ","), deviceEnv+"="+strconv.Itoa(testDevice()))
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	e := &engineProc{t: t, cmd: cmd, stdin: stdin, enc: json.NewEncoder(stdin), resps: make(chan engineResp, 1)}
	go func() {
		defer close(e.resps)
		dec := json.NewDecoder(stdout)
		for {
			var r engineResp
			if dec.Decode(&r) != nil {
				return
			}
			e.resps <- r
		}
	}()
	t.Cleanup(e.stop)
	e.specs = e.next("segment specs").Segments
	require.Len(t, e.specs, len(sizes))
	return e
}

// next waits for the child's next reply, at most engineLimit.
func (e *engineProc) next(what string) engineResp {
	e.t.Helper()
	select {
	case r, ok := <-e.resps:
		require.True(e.t, ok, "engine exited before %s", what)
		require.Empty(e.t, r.Error, "engine: %s", what)
		return r
	case <-time.After(engineLimit):
		_ = e.cmd.Process.Kill()
		require.FailNow(e.t, "timed out", "waited %v for the engine's %s", engineLimit, what)
		return engineResp{}
	}
}

func (e *engineProc) write(seg int, off int64, p []byte) {
	e.t.Helper()
	require.NoError(e.t, e.enc.Encode(engineReq{Op: "write", Seg: seg, Off: off, Data: p}))
	e.next(fmt.Sprintf("write of segment %d", seg))
}

func (e *engineProc) read(seg int, off, n int64) []byte {
	e.t.Helper()
	require.NoError(e.t, e.enc.Encode(engineReq{Op: "read", Seg: seg, Off: off, N: n}))
	return e.next(fmt.Sprintf("read of segment %d", seg)).Data
}

// stop closes stdin, which makes the child free its memory and exit.
func (e *engineProc) stop() {
	_ = e.stdin.Close()
	done := make(chan error, 1)
	go func() { done <- e.cmd.Wait() }()
	select {
	case err := <-done:
		require.NoError(e.t, err, "engine exit")
	case <-time.After(engineLimit):
		_ = e.cmd.Process.Kill()
		require.FailNow(e.t, "timed out", "waited %v for the engine to exit", engineLimit)
	}
}

// openBackend opens a backend on the test device, closed in t.Cleanup.
func openBackend(t testing.TB) *Backend {
	t.Helper()
	b, err := Open(Config{Device: testDevice()})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	return b
}

// ipcHarness: segments live in a child engine and are attached through
// cuIpcOpenMemHandle, exactly as with a real engine.
func ipcHarness() backendtest.Harness {
	return backendtest.Harness{
		New: func(t *testing.T) backend.Backend { return openBackend(t) },
		Segments: func(t *testing.T, sizes []int64) backendtest.Segments {
			e := startEngine(t, sizes)
			return backendtest.Segments{Specs: e.specs, Write: e.write, Read: e.read}
		},
	}
}

// directBackend attaches buffers of this process by their device pointers
// instead of IPC: the whole copy path runs on one GPU process, where the
// driver refuses to open a handle the process exported itself.
type directBackend struct {
	*Backend
	bufs *sync.Map // Segment().CUDAIPC → *DeviceBuffer
}

func (d directBackend) Attach(engine string, segs []messages.Segment) (backend.Attachment, error) {
	parsed, err := parseSegments(d.cfg.Device, segs)
	if err != nil {
		return nil, fmt.Errorf("cuda: engine %q: %w", engine, err)
	}
	var ptrs []cu.DevicePtr
	var sizes []int64
	for i, s := range parsed {
		v, ok := d.bufs.Load(segs[i].CUDAIPC)
		if !ok || v.(*DeviceBuffer).bytes < s.bytes {
			return nil, fmt.Errorf("segment %d: no such buffer: %w", i, backend.ErrBadSegment)
		}
		ptrs = append(ptrs, v.(*DeviceBuffer).ptr)
		sizes = append(sizes, s.bytes)
	}
	dev, err := d.attachPointers(ptrs, sizes)
	if err != nil {
		return nil, err
	}
	return dev, nil
}

func directHarness() backendtest.Harness {
	bufs := &sync.Map{}
	return backendtest.Harness{
		New: func(t *testing.T) backend.Backend { return directBackend{Backend: openBackend(t), bufs: bufs} },
		Segments: func(t *testing.T, sizes []int64) backendtest.Segments {
			eng := openBackend(t)
			var specs []messages.Segment
			var own []*DeviceBuffer
			for _, n := range sizes {
				buf, err := eng.AllocDevice(n)
				require.NoError(t, err)
				key := buf.Segment().CUDAIPC
				bufs.Store(key, buf)
				t.Cleanup(func() {
					bufs.Delete(key)
					require.NoError(t, buf.Free())
				})
				specs = append(specs, buf.Segment())
				own = append(own, buf)
			}
			return backendtest.Segments{
				Specs: specs,
				Write: func(seg int, off int64, p []byte) { require.NoError(t, own[seg].Write(off, p)) },
				Read: func(seg int, off, n int64) []byte {
					p := make([]byte, n)
					require.NoError(t, own[seg].Read(off, p))
					return p
				},
			}
		},
	}
}
