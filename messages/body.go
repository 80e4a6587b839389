package messages

// Bodies of the protocol (docs/PROTOCOL.md; v2 additions are in
// session.go). Field names follow the JSON exactly; unknown fields are
// ignored by encoding/json, which is what forward compatibility asks for.

// EngineSpec is the body of P.E.register.
type EngineSpec struct {
	TokensPerHash     int         `json:"tokens_per_hash"`
	BlocksPerChunk    int         `json:"blocks_per_chunk"`
	NumGPUBlocks      int         `json:"num_gpu_blocks"`
	OffloadPromptOnly bool        `json:"offload_prompt_only"`
	Segments          []Segment   `json:"segments"`
	Groups            []GroupSpec `json:"groups"`
	// Namespace (v2) scopes keys, dedup, lookup, load and eviction; empty
	// means the engine id (share with nobody).
	Namespace string `json:"namespace,omitempty"`
	// MaxModelLen (v2) bounds a request's hashes and block ids; 0 means
	// num_gpu_blocks times the largest tokens_per_block.
	MaxModelLen int `json:"max_model_len,omitempty"`
	// Node (v2, clusters) names the node that must serve this engine; empty
	// lets any node take it.
	Node string `json:"node,omitempty"`
}

// Segment says where one piece of the engine's device memory lives: either a
// POSIX shared-memory object (Shm) or a CUDA allocation exported by IPC.
type Segment struct {
	Shm     string `json:"shm,omitempty"`
	CUDAIPC string `json:"cuda_ipc,omitempty"` // hex of cudaIpcMemHandle_t
	Device  int    `json:"device,omitempty"`
	Bytes   int64  `json:"bytes,omitempty"`
}

// Group kinds.
const (
	KindFull          = "full"
	KindSlidingWindow = "sliding_window"
	KindEagle         = "eagle"
)

// GroupSpec is one KV-cache group of the engine.
type GroupSpec struct {
	Kind           string   `json:"kind"`
	TokensPerBlock int      `json:"tokens_per_block"`
	SlidingWindow  int      `json:"sliding_window,omitempty"`
	Regions        []Region `json:"regions"`
}

// Region is one layer's tensor of a group: GPU block b is the bytes
// [Offset + b*BlockStride, Offset + b*BlockStride + BlockBytes) of Segment.
type Region struct {
	Segment     int   `json:"segment"`
	Offset      int64 `json:"offset"`
	BlockStride int64 `json:"block_stride"`
	BlockBytes  int64 `json:"block_bytes"`
}

// RegisterReply answers P.E.register. v2: every reply names the node and
// its boot.
type RegisterReply struct {
	OK      bool   `json:"ok,omitempty"`
	Error   string `json:"error,omitempty"`
	Node    string `json:"node,omitempty"`
	Boot    string `json:"boot,omitempty"`
	LeaseMS int64  `json:"lease_ms,omitempty"`
}

// ErrorReply is the error reply of every request/reply subject, status
// included: {"error","node","boot"} and nothing else, so no zero count
// ("hit_tokens":0, "loaded_tokens":0) or zeroed snapshot rides along with
// an error.
type ErrorReply struct {
	Error string `json:"error"`
	Node  string `json:"node"`
	Boot  string `json:"boot"`
}

// Release reasons published on P.E.released. ReasonNodeLost is never
// published: it is what an engine concludes when it loses its node.
const (
	ReasonFinished    = "finished"
	ReasonAborted     = "aborted"
	ReasonPreempted   = "preempted"
	ReasonEngineReset = "engine_reset"
	ReasonEngineGone  = "engine_gone"
	ReasonNodeLost    = "node_lost"
)

// Released is the body of P.E.released. v2 adds Epoch (the epoch whose
// events the release answers) and RSeq (1, 2, ... per engine per epoch).
type Released struct {
	Request string `json:"request"`
	Epoch   string `json:"epoch"`
	RSeq    uint64 `json:"rseq"`
	Reason  string `json:"reason"`
}

// StoredChunk names one chunk of a completed store job.
type StoredChunk struct {
	Group int    `json:"group"`
	Index int    `json:"index"`
	Key   string `json:"key"` // lowercase hex
}

// Stored is the body of P.E.stored: one per completed store job.
type Stored struct {
	Request string        `json:"request"`
	Job     uint64        `json:"job"`
	Chunks  []StoredChunk `json:"chunks"`
	Bytes   int64         `json:"bytes"`
}

// KV event types and the media kvactors stores to: host memory, and the
// optional disk tier (--disk-dir).
const (
	KVBlockStored  = "BlockStored"
	KVBlockRemoved = "BlockRemoved"
	MediumCPU      = "CPU"
	MediumDisk     = "DISK"
)

// KVEvent is one vLLM-style KV cache event.
type KVEvent struct {
	Type        string   `json:"type"`
	BlockHashes []string `json:"block_hashes"`
	GroupIdx    int      `json:"group_idx"`
	Medium      string   `json:"medium"`
	Namespace   string   `json:"namespace,omitempty"` // v2
}

// KVEventBatch is the body of P.E.kv_events. TS is seconds since the epoch.
type KVEventBatch struct {
	TS     float64   `json:"ts"`
	Events []KVEvent `json:"events"`
}

// LookupRequest is the body of P.E.lookup.
type LookupRequest struct {
	Hashes []string `json:"hashes"`
}

// LookupReply answers P.E.lookup.
type LookupReply struct {
	HitTokens int    `json:"hit_tokens"`
	Error     string `json:"error,omitempty"`
	Node      string `json:"node,omitempty"`
	Boot      string `json:"boot,omitempty"`
}

// LoadRequest is the body of P.E.load.
type LoadRequest struct {
	Request   string    `json:"request"`
	Hashes    []string  `json:"hashes"`
	NumTokens int       `json:"num_tokens"`
	Blocks    [][]int64 `json:"blocks"`
}

// LoadReply answers P.E.load.
type LoadReply struct {
	OK           bool   `json:"ok,omitempty"`
	LoadedTokens int    `json:"loaded_tokens"`
	RemoteChunks int    `json:"remote_chunks,omitempty"` // v2 clusters
	Error        string `json:"error,omitempty"`
	Node         string `json:"node,omitempty"`
	Boot         string `json:"boot,omitempty"`
}

// HeaderRoom is what a message leaves of the server's max_payload for its
// headers (a trace context, a cluster's stamp, the fetch wire's) and the
// protocol line: NATS counts headers in the payload. A body cut into pieces
// (kv_events, a large job's stored, a fetched chunk) is cut at max_payload
// less this.
const HeaderRoom = 1024
