package pktgen

import (
	"errors"
	"fmt"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
)

// testXDPLiveFrames is BPF_F_TEST_XDP_LIVE_FRAMES: BPF_PROG_RUN turns the
// input into real frames that XDP_REDIRECT sends.
const testXDPLiveFrames = 1 << 1

// ProgRunSender sends with BPF_PROG_RUN in live-frame mode: the kernel runs
// a small XDP program Repeat times per call; the program writes the flow's
// source port (fixing the L4 checksum) and redirects the frame to the
// interface.
type ProgRunSender struct {
	prog  *ebpf.Program
	seq   *ebpf.Map
	frame []byte
}

// ErrProgRunFlows is returned when more flows are asked of prog-run mode
// than source ports exist: the program varies only the source port.
var ErrProgRunFlows = errors.New("pktgen: prog-run mode varies only the source port; at most 64512 flows and one destination")

// OpenProgRun loads the generator program for tpl, redirecting to ifindex
// (an interface in the calling thread's namespace whose peer runs an XDP
// program or has GRO on: a veth refuses redirected frames otherwise).
func OpenProgRun(ifindex int, tpl *Template) (*ProgRunSender, error) {
	spec := tpl.Spec()
	if spec.Flows > SourcePorts || spec.Dsts > 1 {
		return nil, ErrProgRunFlows
	}
	seq, err := ebpf.NewMap(&ebpf.MapSpec{Name: "pktgen_seq", Type: ebpf.PerCPUArray, KeySize: 4, ValueSize: 8, MaxEntries: 1})
	if err != nil {
		return nil, fmt.Errorf("pktgen: sequence map: %w", err)
	}
	frame := make([]byte, tpl.Len())
	tpl.Write(frame, 0)
	prog, err := ebpf.NewProgram(&ebpf.ProgramSpec{
		Name: "pktgen_tx", Type: ebpf.XDP, License: "GPL",
		Instructions: generatorProgram(seq.FD(), ifindex, spec.Flows, tpl.csumOff),
	})
	if err != nil {
		seq.Close()
		return nil, fmt.Errorf("pktgen: loading the generator program: %w", err)
	}
	return &ProgRunSender{prog: prog, seq: seq, frame: frame}, nil
}

// generatorProgram: seq = per-CPU counter++; sport = 1024 + seq%flows;
// rewrite the source port, update the checksum (RFC 1624: C' = ~(~C + ~m +
// m')), and bpf_redirect(ifindex). All 16-bit values stay in the byte order
// they have in memory; one's complement sums do not care, as long as all
// three are in the same order.
func generatorProgram(seqFD, ifindex, flows, csumOff int) asm.Instructions {
	const sportOff = l4Off
	insns := asm.Instructions{
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.StoreImm(asm.RFP, -4, 0, asm.Word),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, -4),
		asm.LoadMapPtr(asm.R1, seqFD),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "redirect"),
		asm.LoadMem(asm.R7, asm.R0, 0, asm.DWord),
		asm.Mov.Reg(asm.R8, asm.R7),
		asm.Add.Imm(asm.R8, 1),
		asm.StoreMem(asm.R0, 0, asm.R8, asm.DWord),
		asm.Mod.Imm(asm.R7, int32(flows)),
		asm.Add.Imm(asm.R7, FirstSourcePort),
		asm.HostTo(asm.BE, asm.R7, asm.Half),
		asm.LoadMem(asm.R2, asm.R6, 0, asm.Word), // data
		asm.LoadMem(asm.R3, asm.R6, 4, asm.Word), // data_end
		asm.Mov.Reg(asm.R4, asm.R2),
		asm.Add.Imm(asm.R4, int32(csumOff+2)),
		asm.JGT.Reg(asm.R4, asm.R3, "redirect"),
		asm.LoadMem(asm.R5, asm.R2, sportOff, asm.Half),
		asm.StoreMem(asm.R2, sportOff, asm.R7, asm.Half),
		asm.LoadMem(asm.R4, asm.R2, int16(csumOff), asm.Half),
		asm.Xor.Imm(asm.R4, 0xffff),
		asm.Xor.Imm(asm.R5, 0xffff),
		asm.Add.Reg(asm.R4, asm.R5),
		asm.Add.Reg(asm.R4, asm.R7),
		asm.Mov.Reg(asm.R5, asm.R4),
		asm.RSh.Imm(asm.R5, 16),
		asm.And.Imm(asm.R4, 0xffff),
		asm.Add.Reg(asm.R4, asm.R5),
		asm.Mov.Reg(asm.R5, asm.R4),
		asm.RSh.Imm(asm.R5, 16),
		asm.And.Imm(asm.R4, 0xffff),
		asm.Add.Reg(asm.R4, asm.R5),
		asm.Xor.Imm(asm.R4, 0xffff),
		asm.StoreMem(asm.R2, int16(csumOff), asm.R4, asm.Half),
		asm.Mov.Imm(asm.R1, int32(ifindex)).WithSymbol("redirect"),
		asm.Mov.Imm(asm.R2, 0),
		asm.FnRedirect.Call(),
		asm.Return(),
	}
	return insns
}

// Close unloads the program.
func (s *ProgRunSender) Close() error {
	return errors.Join(s.prog.Close(), s.seq.Close())
}

// runs is how many times the program has run, summed over CPUs.
func (s *ProgRunSender) runs() (uint64, error) {
	var per []uint64
	if err := s.seq.Lookup(uint32(0), &per); err != nil {
		return 0, err
	}
	var n uint64
	for _, v := range per {
		n += v
	}
	return n, nil
}

// Send runs the program in chunks: 100ms worth of packets per
// BPF_PROG_RUN call when paced (a call has a fixed setup cost of several
// milliseconds, so shorter chunks cannot reach high rates) (each call sends its chunk at full speed,
// then the sender sleeps to the schedule), 1M per call otherwise. Sent is
// read from the program's own counter.
func (s *ProgRunSender) Send(b Budget, stop <-chan struct{}) (Result, error) {
	if b.Duration <= 0 && b.Count == 0 {
		return Result{}, fmt.Errorf("pktgen: budget needs a duration or a count")
	}
	if b.Seq != 0 {
		return Result{}, fmt.Errorf("pktgen: prog-run mode always starts at flow 0 (Budget.Seq %d)", b.Seq)
	}
	res := Result{Mode: "prog-run", Offered: b.Rate}
	before, err := s.runs()
	if err != nil {
		return res, err
	}
	chunk := uint64(1 << 20)
	if b.Rate > 0 {
		chunk = max(64, uint64(b.Rate/10))
	}
	start := time.Now()
	var planned uint64
	var elapsed time.Duration
	for {
		elapsed = time.Since(start)
		if (b.Duration > 0 && elapsed >= b.Duration) || (b.Count > 0 && planned >= b.Count) {
			break
		}
		select {
		case <-stop:
			b.Duration = 0
			b.Count = planned
			continue
		default:
		}
		if b.Rate > 0 {
			due := time.Duration(float64(planned) / b.Rate * 1e9)
			if due > elapsed {
				time.Sleep(due - elapsed)
				continue
			}
		}
		n := chunk
		if b.Count > 0 {
			n = min(n, b.Count-planned)
		}
		if _, err := s.prog.Run(&ebpf.RunOptions{Data: s.frame, Repeat: uint32(n), Flags: testXDPLiveFrames, BatchSize: 64}); err != nil {
			return res, fmt.Errorf("pktgen: BPF_PROG_RUN: %w", err)
		}
		planned += n
	}
	after, err := s.runs()
	if err != nil {
		return res, err
	}
	res.Sent = after - before
	res.finish(elapsed)
	return res, nil
}
