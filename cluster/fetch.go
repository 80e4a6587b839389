package cluster

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/messages"
)

// Fetch wire (P._node.<node>.fetch, request/reply). Request body, JSON:
// {"namespace":"m","key":"<hex>","offset":0,"max":1047552}. Reply: the
// bytes [offset, offset+n) of the chunk as the raw body (n ≤ max and ≤ the
// serving connection's max_payload less messages.HeaderRoom), with headers
// Kvactors-Size (the whole chunk's length), Kvactors-Crc32c (CRC-32C,
// Castagnoli, of the whole chunk, 8 hex digits) and Kvactors-Offset; or no
// body and Kvactors-Error naming what is wrong.
const (
	HeaderSize   = "Kvactors-Size"
	HeaderCRC    = "Kvactors-Crc32c"
	HeaderOffset = "Kvactors-Offset"
	HeaderError  = "Kvactors-Error"
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// CRC32C is the chunk checksum the fetch wire carries.
func CRC32C(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// ChunkSource is what a fetch server reads chunks from (the node's pool):
// the whole chunk and the CRC-32C computed when it was copied from the
// device. ErrNoChunk (wrapped) if the pool does not hold the key.
type ChunkSource interface {
	ReadChunk(ns string, key messages.Key) ([]byte, uint32, error)
}

// ChunkSourceFunc adapts a function to ChunkSource.
type ChunkSourceFunc func(ns string, key messages.Key) ([]byte, uint32, error)

// ReadChunk calls f.
func (f ChunkSourceFunc) ReadChunk(ns string, key messages.Key) ([]byte, uint32, error) {
	return f(ns, key)
}

// Errors of fetch. Every client error names the node, namespace and key.
var (
	ErrNoChunk    = errors.New("no such chunk") // for ChunkSource implementations
	ErrRefused    = errors.New("serving node refused")
	ErrCorrupt    = errors.New("checksum mismatch")
	ErrPiece      = errors.New("bad or missing piece")
	ErrFetchInput = errors.New("bad fetch request")
)

type fetchRequest struct {
	Namespace string `json:"namespace"`
	Key       string `json:"key"`
	Offset    int64  `json:"offset"`
	Max       int64  `json:"max"`
}

// ServeFetch answers P._node.<node>.fetch from src on nc until the
// subscription is drained or the connection closed. Each request reads the
// chunk from src again (a pool read is a slice reference, not a copy) so
// the server keeps no per-fetch state.
func ServeFetch(nc *nats.Conn, prefix, node string, src ChunkSource, metrics *Metrics) (*nats.Subscription, error) {
	subj := messages.NodeSubject(prefix, node, messages.NodeVerbFetch)
	metrics = metrics.orNew()
	sub, err := nc.Subscribe(subj, func(m *nats.Msg) { serveFetch(nc, m, src, metrics) })
	if err != nil {
		return nil, fmt.Errorf("subscribe %s: %w", subj, err)
	}
	return sub, nil
}

func serveFetch(nc *nats.Conn, m *nats.Msg, src ChunkSource, metrics *Metrics) {
	reply := nats.NewMsg(m.Reply)
	data, err := fetchPiece(nc.MaxPayload(), m.Data, src, reply.Header)
	if err != nil {
		reply.Header.Set(HeaderError, err.Error())
		metrics.ServeRefused.Inc()
	} else {
		reply.Data = data
		metrics.ServedBytes.Add(float64(len(data)))
	}
	_ = m.RespondMsg(reply) // a requester that went away is not this server's error
}

func fetchPiece(maxPayload int64, body []byte, src ChunkSource, h nats.Header) ([]byte, error) {
	var req fetchRequest
	if err := json.Unmarshal(body, &req); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrFetchInput, err)
	}
	raw, err := hex.DecodeString(req.Key)
	if err != nil || len(raw) == 0 || req.Namespace == "" || req.Offset < 0 || req.Max < 1 {
		return nil, fmt.Errorf("%w: namespace %q key %q offset %d max %d", ErrFetchInput, req.Namespace, req.Key, req.Offset, req.Max)
	}
	chunk, crc, err := src.ReadChunk(req.Namespace, messages.Key(raw))
	if err != nil {
		return nil, fmt.Errorf("%s/%s: %w", req.Namespace, req.Key, err)
	}
	size := int64(len(chunk))
	if req.Offset > size {
		return nil, fmt.Errorf("%w: offset %d past size %d", ErrFetchInput, req.Offset, size)
	}
	n := min(req.Max, maxPayload-messages.HeaderRoom, size-req.Offset)
	if n < 1 && req.Offset < size { // a server whose max_payload leaves no room past the headers
		return nil, fmt.Errorf("%w: max_payload %d leaves no room for a piece", ErrFetchInput, maxPayload)
	}
	h.Set(HeaderSize, strconv.FormatInt(size, 10))
	h.Set(HeaderCRC, fmt.Sprintf("%08x", crc))
	h.Set(HeaderOffset, strconv.FormatInt(req.Offset, 10))
	return chunk[req.Offset : req.Offset+n], nil
}

// Fetcher fetches chunks from other nodes. Safe for concurrent use.
type Fetcher struct {
	nc      *nats.Conn
	cfg     Config
	metrics *Metrics
}

// NewFetcher returns a fetch client on nc; metrics may be nil.
func NewFetcher(nc *nats.Conn, cfg Config, metrics *Metrics) (*Fetcher, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Fetcher{nc: nc, cfg: cfg, metrics: metrics.orNew()}, nil
}

// piece is one verified reply.
type piece struct {
	size, offset int64
	crc          uint32
	data         []byte
}

// Fetch reads ns/key from node into a new buffer (see FetchTo).
func (f *Fetcher) Fetch(ctx context.Context, node, ns string, key messages.Key) ([]byte, error) {
	return f.FetchTo(ctx, node, ns, key, func(size int64) ([]byte, error) { return make([]byte, size), nil })
}

// FetchTo reads ns/key from node into the buffer alloc returns for the
// chunk's size (a pool slot, so the bytes are copied once): the first piece
// says the size and the checksum, the rest are requested FetchWindow at a
// time, and the whole is verified against the checksum. Any error names the
// node, namespace and key; the buffer's contents are then undefined and
// must not be used (the caller frees the slot).
func (f *Fetcher) FetchTo(ctx context.Context, node, ns string, key messages.Key, alloc func(size int64) ([]byte, error)) ([]byte, error) {
	start := time.Now()
	b, err := f.fetchTo(ctx, node, ns, key, alloc)
	if err != nil {
		f.metrics.FetchFailures.WithLabelValues(fetchReason(err)).Inc()
		return nil, err
	}
	f.metrics.FetchBytes.Add(float64(len(b)))
	f.metrics.FetchSeconds.Observe(time.Since(start).Seconds())
	return b, nil
}

func (f *Fetcher) fetchTo(ctx context.Context, node, ns string, key messages.Key, alloc func(size int64) ([]byte, error)) ([]byte, error) {
	name := fmt.Sprintf("key %s/%x from node %s", ns, []byte(key), node)
	subj := messages.NodeSubject(f.cfg.Prefix, node, messages.NodeVerbFetch)
	pieceMax := f.nc.MaxPayload() - messages.HeaderRoom
	first, err := f.piece(ctx, subj, ns, key, 0, pieceMax)
	if err != nil {
		return nil, fmt.Errorf("fetch %s: %w", name, err)
	}
	if first.size > f.cfg.MaxChunkBytes {
		return nil, fmt.Errorf("fetch %s: %w: size %d over the %d limit", name, ErrPiece, first.size, f.cfg.MaxChunkBytes)
	}
	// The server may cut pieces shorter than asked (its own max_payload);
	// its first piece's length is the stride.
	stride := int64(len(first.data))
	if stride == 0 && first.size > 0 {
		return nil, fmt.Errorf("fetch %s: %w: empty first piece of a %d-byte chunk", name, ErrPiece, first.size)
	}
	buf, err := alloc(first.size)
	if err != nil {
		return nil, fmt.Errorf("fetch %s: room for %d bytes: %w", name, first.size, err)
	}
	if int64(len(buf)) != first.size {
		return nil, fmt.Errorf("fetch %s: buffer of %d bytes for a %d-byte chunk", name, len(buf), first.size)
	}
	copy(buf, first.data)
	if err := f.rest(ctx, subj, ns, key, buf, first, stride); err != nil {
		return nil, fmt.Errorf("fetch %s: %w", name, err)
	}
	if got := CRC32C(buf); got != first.crc {
		return nil, fmt.Errorf("fetch %s: %w: got %08x, want %08x", name, ErrCorrupt, got, first.crc)
	}
	return buf, nil
}

// FetchAny fetches ns/key from the first of holders that serves it intact,
// in order (the caller's preference: the index's, or nearest first). It
// returns the node that served it, or every holder's error joined.
func (f *Fetcher) FetchAny(ctx context.Context, holders []string, ns string, key messages.Key, alloc func(size int64) ([]byte, error)) ([]byte, string, error) {
	var errs []error
	for _, node := range holders {
		b, err := f.FetchTo(ctx, node, ns, key, alloc)
		if err == nil {
			return b, node, nil
		}
		errs = append(errs, err)
		if ctx.Err() != nil {
			break
		}
	}
	if len(errs) == 0 {
		return nil, "", fmt.Errorf("fetch key %s/%x: %w: no holder", ns, []byte(key), ErrRefused)
	}
	return nil, "", errors.Join(errs...)
}

// rest fetches every piece after the first into buf, FetchWindow at a time.
func (f *Fetcher) rest(ctx context.Context, subj, ns string, key messages.Key, buf []byte, first piece, stride int64) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		firstErr error
	)
	sem := make(chan struct{}, f.cfg.FetchWindow)
	for off := stride; off < first.size; off += stride {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		wg.Add(1)
		go func(off int64) {
			defer wg.Done()
			defer func() { <-sem }()
			want := min(stride, first.size-off)
			p, err := f.piece(ctx, subj, ns, key, off, want)
			if err == nil {
				err = p.matches(first, off, want)
			}
			if err != nil {
				mu.Lock()
				if firstErr == nil {
					firstErr = err
					cancel()
				}
				mu.Unlock()
				return
			}
			copy(buf[off:], p.data)
		}(off)
	}
	wg.Wait()
	if firstErr == nil && ctx.Err() != nil {
		firstErr = ctx.Err()
	}
	return firstErr
}

func (p piece) matches(first piece, off, want int64) error {
	switch {
	case p.size != first.size || p.crc != first.crc:
		return fmt.Errorf("%w at offset %d: chunk changed (size %d crc %08x, first said %d %08x)", ErrPiece, off, p.size, p.crc, first.size, first.crc)
	case p.offset != off:
		return fmt.Errorf("%w at offset %d: reply for offset %d", ErrPiece, off, p.offset)
	case int64(len(p.data)) != want:
		return fmt.Errorf("%w at offset %d: %d bytes, want %d", ErrPiece, off, len(p.data), want)
	}
	return nil
}

// piece requests [off, off+max) and parses the reply's headers.
func (f *Fetcher) piece(ctx context.Context, subj, ns string, key messages.Key, off, max int64) (piece, error) {
	body, _ := json.Marshal(fetchRequest{Namespace: ns, Key: hex.EncodeToString([]byte(key)), Offset: off, Max: max})
	rctx, cancel := context.WithTimeout(ctx, f.cfg.FetchTimeout)
	defer cancel()
	m, err := f.nc.RequestWithContext(rctx, subj, body)
	if err != nil {
		return piece{}, fmt.Errorf("%w at offset %d: %w", ErrPiece, off, err)
	}
	if e := m.Header.Get(HeaderError); e != "" {
		return piece{}, fmt.Errorf("%w at offset %d: %s", ErrRefused, off, e)
	}
	size, err1 := strconv.ParseInt(m.Header.Get(HeaderSize), 10, 64)
	crc, err2 := strconv.ParseUint(m.Header.Get(HeaderCRC), 16, 32)
	offset, err3 := strconv.ParseInt(m.Header.Get(HeaderOffset), 10, 64)
	if err := errors.Join(err1, err2, err3); err != nil || size < 0 {
		return piece{}, fmt.Errorf("%w at offset %d: headers: %v", ErrPiece, off, err)
	}
	if offset != off || offset+int64(len(m.Data)) > size {
		return piece{}, fmt.Errorf("%w at offset %d: reply covers [%d, %d) of %d", ErrPiece, off, offset, offset+int64(len(m.Data)), size)
	}
	return piece{size: size, offset: offset, crc: uint32(crc), data: m.Data}, nil
}
