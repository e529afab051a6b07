//! A traffic model of the spiking network's GPU engine (`bench bptt --device gpu`): per
//! kernel, the bytes one optimizer step must move between the GPU's memory (DRAM, HBM) and
//! its cores, the L2 traffic of the random accesses whose arrays fit in L2, and the launches;
//! with a bandwidth, the modelled time of the step. It is a model, printed as one beside the
//! measured time: on lavapipe the measured time says nothing about a GPU, and on a GPU the
//! difference between the two says where the kernels lose time (latency, idle lanes,
//! launches).
//!
//! The rules (the same for every kernel, from the kernels in
//! `crates/lockstep-snn/src/training/gpu/bptt.wgsl`):
//!
//! * an array read or written in order (coalesced) moves its bytes from or to DRAM: no reuse
//!   across kernels is assumed (a conservative choice: small state arrays that stay in L2
//!   are counted as DRAM traffic);
//! * a random access moves a 32-byte sector: from DRAM when the array it reads is larger
//!   than the L2 (`l2_bytes`), else from L2 (counted apart, not in the modelled time);
//! * values that all lanes of a (target, port) or a source share (edge indices, weights of
//!   the gather) are loaded once per edge, not once per sample lane;
//! * a random access into an array of at most [`L1_BYTES`] (per step: the spike masks'
//!   any-sample bitmap) is served by each SM's L1 after one fill: the array's bytes per SM
//!   ([`SMS`]) and launch count as L2 traffic (at most the accesses' sectors), the accesses
//!   not at all;
//! * the spike probability per (neuron, sample, step), `p`, is the measured one; a source
//!   fired in some sample with probability `1 - (1 - p)^batch` (independent samples);
//! * each launch costs `launch_s` of GPU time (default 4 us: dispatch plus the barrier after
//!   it on a busy queue).
//!
//! `Design::Round1` models the kernels before issue 57 (three dispatches per step each way,
//! the weight gradient walked by one lane in `batch` with a device-scope atomic load of a
//! spike word per sample and edge, separate draw and arrival-adjoint kernels, the gradient
//! read back in float64 and the weights uploaded every step for the host's Adam) for the
//! before/after table in `docs/v1-scale-performance.md`. `Design::Current` keeps the training
//! state on the device (one replica): the parameters copied into the kernels' weights, each
//! pass's gradient added into the update's, Adam as a kernel; what crosses the host bus is
//! modelled apart ([`bus_bytes`], at an assumed [`BUS_BYTES_PER_S`]).

/// Which kernels the model describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Design {
    /// The kernels before issue 57 (commit 8192bdc).
    Round1,
    /// The kernels of this build.
    Current,
}

/// The shape of one optimizer step on one replica.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// Neurons.
    pub n: usize,
    /// Receptor ports per neuron (array width; at least 1).
    pub ports: usize,
    /// Rows of the adjoint ring per slot: per neuron, its group's live ports (ports some
    /// edge reaches).
    pub live_rows: usize,
    /// After-spike currents per neuron (array width).
    pub asc: usize,
    /// Samples per replica.
    pub batch: usize,
    /// Time steps.
    pub steps: usize,
    /// Largest delay (steps).
    pub max_delay: usize,
    /// Recurrent edges.
    pub e_rec: usize,
    /// Input edges.
    pub e_in: usize,
    /// Segments (source, delay, port) of the recurrent out-edge lists.
    pub segments: usize,
    /// Input (virtual) nodes.
    pub n_virtual: usize,
    /// Poisson input nodes.
    pub n_poisson: usize,
    /// Segmented BPTT's chunk (steps), if any: the forward pass runs twice.
    pub chunk: Option<usize>,
    /// Whether the input weights are trained.
    pub train_in: bool,
    /// Spike probability per (neuron, sample, step).
    pub p_spike: f64,
    /// Rate losses (`TargetFiringRate`): per rate loss a target per neuron.
    pub rate_losses: usize,
}

/// One kernel's modelled work per optimizer step.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTraffic {
    /// The kernel (entry point of `bptt.wgsl`).
    pub kernel: &'static str,
    /// Launches per optimizer step.
    pub launches: f64,
    /// Bytes to or from DRAM per optimizer step.
    pub dram_bytes: f64,
    /// Bytes of random accesses served by L2 per optimizer step.
    pub l2_bytes: f64,
}

/// The sector a random access moves (bytes).
const SECTOR: f64 = 32.0;

/// The L1 data cache per SM the model assumes for small read-only arrays (bytes): half of
/// an H100/H200 SM's 256 KB of L1 and shared memory.
pub const L1_BYTES: f64 = 128.0 * 1024.0;

/// SMs of the GPU the model assumes (an H200's 132), for the L1 fills.
pub const SMS: f64 = 132.0;

/// The host bus bandwidth the model assumes for read-backs and uploads (bytes/s): about half
/// of PCIe 5.0 x16's 64 GB/s per direction, for copies through a staging buffer.
pub const BUS_BYTES_PER_S: f64 = 25e9;

/// Bytes that cross the host bus per optimizer step of one replica. Round 1 read the spike
/// counts and voltage sums back (12 bytes per neuron and sample), uploaded the rate losses'
/// derivatives (4), read the float64 gradient back and uploaded the weights (12 bytes per
/// trainable weight) and the initial state (4 bytes per neuron, sample and state value:
/// potential, after-spike currents, PSCs and arrivals per port). Now the training state
/// stays on the device, the initial state is copied there from a buffer uploaded once, and
/// the loss sums are reduced there (`loss_sums`; the 64-bit kernels: 4 bytes less per sum
/// and 4 less up with the 32-bit ones): 8 bytes per sample and sum (the rate
/// losses', the voltage regularization's, the spike count) and the 4-byte non-finite flag
/// come back, and 28 bytes go up (the surrogate, the regularization coefficient, the
/// batch's first sample).
pub fn bus_bytes(s: &Shape, design: Design) -> f64 {
    let trainable = (s.e_rec + if s.train_in { s.e_in } else { 0 }) as f64;
    let nb = (s.n * s.batch) as f64;
    let state = 4.0 * nb * (1 + s.asc + 3 * s.ports.max(1)) as f64;
    match design {
        Design::Round1 => 12.0 * trainable + state + 16.0 * nb,
        Design::Current => 8.0 * ((s.rate_losses + 2) * s.batch) as f64 + 4.0 + 28.0,
    }
}

/// Accumulates one kernel's bytes for one launch (then scaled by its launches).
#[derive(Default)]
struct Bytes {
    dram: f64,
    l2: f64,
    l2_size: f64,
}

impl Bytes {
    fn new(l2_bytes: f64) -> Bytes {
        Bytes {
            l2_size: l2_bytes,
            ..Default::default()
        }
    }
    /// `bytes` read or written in order.
    fn stream(&mut self, bytes: f64) {
        self.dram += bytes;
    }
    /// `count` random accesses of `each` bytes (whole sectors) into an array of `array`
    /// bytes.
    fn random(&mut self, count: f64, each: f64, array: f64) {
        let b = count * (each / SECTOR).ceil().max(1.0) * SECTOR;
        if array <= L1_BYTES {
            self.l2 += (array * SMS).min(b);
        } else if array > self.l2_size {
            self.dram += b;
        } else {
            self.l2 += b;
        }
    }
}

/// The model of one optimizer step of `s` under `design`, with an L2 of `l2_bytes`.
pub fn model(s: &Shape, design: Design, l2_bytes: f64) -> Vec<KernelTraffic> {
    let f = |x: usize| x as f64;
    let (n, np, na, b, t) = (f(s.n), f(s.ports.max(1)), f(s.asc), f(s.batch), f(s.steps));
    let (e_rec, e_in) = (f(s.e_rec), f(s.e_in));
    let w = f(s.batch.div_ceil(32));
    let rl = f(s.max_delay + 1);
    let weights_bytes = 4.0 * (e_rec + e_in);
    let masks_window = 4.0 * 2.0 * rl * n * w;
    // The adjoint ring: a row per neuron and live port now, per neuron and port in round 1.
    let ring_bytes = match design {
        Design::Current => 4.0 * rl * f(s.live_rows) * b,
        Design::Round1 => 4.0 * rl * n * np * b,
    };
    let pring_bytes = 4.0 * rl * f(s.n_virtual) * b;
    let fired_source = 1.0 - (1.0 - s.p_spike.clamp(0.0, 1.0)).powf(b);
    // Forward steps: once, twice when segmented (the chunks recomputed).
    let fwd_steps = t * if s.chunk.is_some() { 2.0 } else { 1.0 };
    let mut out = Vec::new();
    let mut push = |kernel: &'static str, launches: f64, per_launch: Bytes| {
        out.push(KernelTraffic {
            kernel,
            launches,
            dram_bytes: per_launch.dram * launches,
            l2_bytes: per_launch.l2 * launches,
        });
    };

    // Current: once per call, the recurrent weights put in the in-edge lists' order (the
    // slot streamed, the weight gathered, the copy written).
    if design == Design::Current {
        let mut pw = Bytes::new(l2_bytes);
        pw.stream(8.0 * e_rec);
        pw.random(e_rec, 4.0, weights_bytes);
        push("permute_weights", 1.0, pw);
    }
    // deliver: per (target, port) class the in-edge lists of each delay; per recurrent
    // in-edge its source and its weight (Current: streamed in in-edge order; Round 1: the
    // weight slot streamed and the weight gathered from the parameters' order), the
    // source's mask word (random, the last max_delay steps' masks); per input edge its node
    // and weight slot, the weight, the node's counts of the batch (one row); the arrivals.
    // Current with batch <= 32: the source's bit in the step's any-sample bitmap first (per
    // step ceil(n / npw) ceil(npw / 32) words, npw = 256 / batch neurons per word group:
    // L1-resident), and the mask word and weight only for sources that fired in some sample
    // (the weights' 32-byte sectors of 8 still read where any of their edges is live).
    let mut d = Bytes::new(l2_bytes);
    d.stream(2.0 * 8.0 * n * np * f(s.max_delay.max(1)));
    let bitmap = design == Design::Current && s.batch <= 32;
    if bitmap {
        let npw = (256 / s.batch.max(1)) as f64;
        let any_words = (n / npw).ceil() * (npw / 32.0).ceil();
        d.stream(4.0 * e_rec);
        d.stream(4.0 * e_rec * (1.0 - (1.0 - fired_source).powi(8)));
        d.random(e_rec, 4.0, 4.0 * f(s.max_delay.max(1)) * any_words);
        d.random(e_rec * fired_source, 4.0, masks_window);
    } else {
        d.stream(8.0 * e_rec);
        if design == Design::Round1 {
            d.random(e_rec, 4.0, weights_bytes);
        }
        d.random(e_rec, 4.0, masks_window);
    }
    d.stream(8.0 * e_in);
    d.random(e_in, 4.0, 4.0 * e_in);
    if s.n_poisson > 0 {
        d.random(e_in, 4.0 * b, pring_bytes);
    }
    d.stream(4.0 * n * np * b);
    push("deliver", fwd_steps, d);

    // The neuron update: state read and written in order (u, refractory counter, after-spike
    // currents, PSCs y1 and y2, arrivals), the tape (u, after-spike currents), the masks,
    // the loss sums (first pass only, counted every step: small).
    let update_bytes = |bb: &mut Bytes| {
        let per = 4.0 * (2.0 + na + 3.0 * np) + 4.0 * (4.0 + 2.0 * na + 2.0 * np) + 20.0;
        bb.stream(per * n * b);
        bb.stream(2.0 * 4.0 * n * w);
    };
    let draw_bytes = |bb: &mut Bytes| {
        bb.stream(4.0 * f(s.n_poisson) * b + 20.0 * f(s.n_poisson));
    };
    match design {
        Design::Current => {
            let mut u = Bytes::new(l2_bytes);
            update_bytes(&mut u);
            draw_bytes(&mut u);
            push("update_draw", fwd_steps, u);
        }
        Design::Round1 => {
            let mut u = Bytes::new(l2_bytes);
            update_bytes(&mut u);
            push("update", fwd_steps, u);
            if s.n_poisson > 0 {
                let mut dr = Bytes::new(l2_bytes);
                draw_bytes(&mut dr);
                push("draw", fwd_steps, dr);
            }
        }
    }

    // Segmented: the Poisson draws of the max_delay steps before each recomputed chunk but
    // the first.
    if let Some(k) = s.chunk {
        let before_chunks = (s.steps.div_ceil(k.max(1)).saturating_sub(1) * s.max_delay) as f64;
        if s.n_poisson > 0 && before_chunks > 0.0 {
            let mut dr = Bytes::new(l2_bytes);
            draw_bytes(&mut dr);
            push("draw (chunks)", before_chunks, dr);
        }
    }

    // The adjoint gather: per source its segments; per out-edge its weight and target
    // (streamed once for the source's lanes) and the target's adjoint row of the batch
    // (random in the ring); then for sources that fired, per out-edge the f64 gradient read
    // and written (the row again, from L1). Round 1 also loaded, per edge and sample, the
    // spike word with a device-scope atomic (an L2 access each).
    let mut g = Bytes::new(l2_bytes);
    g.stream(8.0 * n + 16.0 * f(s.segments));
    g.stream(8.0 * e_rec);
    g.random(e_rec, 4.0 * b, ring_bytes);
    g.stream(16.0 * e_rec * fired_source);
    g.stream(3.0 * 4.0 * n * b);
    if design == Design::Round1 {
        g.random(e_rec * fired_source * b, 4.0, masks_window);
    }
    let mut input_grad = Bytes::new(l2_bytes);
    if s.train_in {
        input_grad.stream((12.0 + 16.0) * e_in);
        input_grad.random(e_in, 4.0 * b, ring_bytes);
        if s.n_poisson > 0 {
            input_grad.random(e_in, 4.0 * b, pring_bytes);
        }
    }
    match design {
        Design::Current => {
            g.dram += input_grad.dram;
            g.l2 += input_grad.l2;
            if s.train_in {
                draw_bytes(&mut g);
            }
            push("spmv_in", t, g);
        }
        Design::Round1 => {
            push("spmv", t, g);
            if s.train_in {
                push("input_grad", t, input_grad);
                let mut dr = Bytes::new(l2_bytes);
                draw_bytes(&mut dr);
                push("draw (backward)", t, dr);
            }
        }
    }

    // The training state on the device (Current, one replica, Adam): the parameters copied
    // into the kernels' weights (a copy command, not a dispatch, but modelled as one launch
    // for its cost, as the initial state's copy); the pass's float64
    // gradient read and added into the update's float32 gradient; Adam over the parameters,
    // the gradient, m and v (each read and written but the gradient, which the update's
    // clear writes instead), and the packed sign codes.
    if design == Design::Current {
        let trainable = e_rec + if s.train_in { e_in } else { 0.0 };
        let mut c = Bytes::new(l2_bytes);
        c.stream(8.0 * trainable);
        push("params copy", 1.0, c);
        // The initial state copied from the buffer uploaded once (read and written): the
        // potential, after-spike currents, PSCs and arrivals of every neuron and sample.
        let mut st = Bytes::new(l2_bytes);
        st.stream(8.0 * n * b * (1.0 + na + 3.0 * np));
        push("state copy", 1.0, st);
        let mut a = Bytes::new(l2_bytes);
        a.stream(16.0 * trainable);
        push("accumulate", 1.0, a);
        let mut o = Bytes::new(l2_bytes);
        o.stream(32.25 * trainable);
        push("adam", 1.0, o);
    }

    // Current: the loss sums once per call after the forward pass (`loss_sums`): per (neuron,
    // sample) its count read and its rate losses' derivative written, the targets; then per
    // sample and sum a loop over the neurons reading the counts (the rate losses' and the
    // spike count) or the voltage sums and the targets. (Each sum is one invocation's loop
    // over the neurons: latency-bound, about N dependent additions; not in these bytes.)
    if design == Design::Current {
        let r = f(s.rate_losses);
        let mut ls = Bytes::new(l2_bytes);
        ls.stream(8.0 * n * b + 8.0 * r * n);
        ls.stream((r + 1.0) * 4.0 * n * b + 8.0 * n * b + r * 8.0 * n);
        push("loss_sums", 1.0, ls);
    }

    // The neuron's adjoint: the tape (u, after-spike currents), the adjoint state (u,
    // after-spike currents, y1, y2) read and written, the spike adjoint, the masks; then the
    // arrivals' adjoint into the ring. Round 1 read y1, the tape's u and the masks again in
    // a separate kernel.
    let mut nb = Bytes::new(l2_bytes);
    nb.stream(4.0 * (1.0 + na + 1.0 + na + 2.0 * np + 1.0) * n * b);
    nb.stream(4.0 * (1.0 + na + 2.0 * np + np) * n * b);
    nb.stream(2.0 * 4.0 * n * w);
    match design {
        Design::Current => push("neuron_backward", t, nb),
        Design::Round1 => {
            push("local_backward", t, nb);
            let mut aa = Bytes::new(l2_bytes);
            aa.stream(4.0 * (np + 1.0) * n * b + 2.0 * 4.0 * n * w);
            push("arrivals_adjoint", t, aa);
        }
    }
    out
}

/// The modelled time of `rows` (seconds): DRAM bytes at `bandwidth` (bytes/s) plus
/// `launch_s` per launch. L2 traffic is not counted (an L2 serves several times the DRAM
/// bandwidth; its share is printed apart).
pub fn modelled_s(rows: &[KernelTraffic], bandwidth: f64, launch_s: f64) -> f64 {
    rows.iter()
        .map(|r| r.dram_bytes / bandwidth + r.launches * launch_s)
        .sum()
}

/// The shape of `model`'s step at `batch` samples with spike probability `p_spike`.
pub fn shape_of(model: &lockstep_snn::SnnModel, batch: usize, p_spike: f64) -> Shape {
    let net = &model.net;
    let o = model.options();
    let live_rows = net
        .groups
        .iter()
        .zip(net.live_ports())
        .map(|(g, live)| (g.end - g.start) * live.len())
        .sum();
    Shape {
        n: net.n_neurons(),
        ports: net.n_ports.max(1),
        live_rows,
        asc: net.n_asc,
        batch,
        steps: o.seq_len,
        max_delay: net.max_delay,
        e_rec: net.weights_rec.len(),
        e_in: net.weights_in.len(),
        segments: net.recurrent.segments.len(),
        n_virtual: net.n_virtual(),
        n_poisson: model.inputs.n_poisson(),
        chunk: o.gradient_checkpointing,
        train_in: o.train_input_weights,
        p_spike,
        rate_losses: o
            .losses
            .iter()
            .filter(|l| matches!(l, lockstep_snn::Loss::TargetFiringRate { .. }))
            .count(),
    }
}

/// Prints the model of `shape` for the current kernels beside round 1's, with the modelled
/// times at `bandwidth` (and, as a second figure, with the L2 traffic at `l2_bandwidth`) and
/// the measured time of the step `measured_s`, labelled as a model.
pub fn print(
    shape: &Shape,
    l2_bytes: f64,
    bandwidth: f64,
    l2_bandwidth: f64,
    launch_s: f64,
    measured_s: f64,
) {
    let now = model(shape, Design::Current, l2_bytes);
    let before = model(shape, Design::Round1, l2_bytes);
    println!(
        "  traffic MODEL (not a measurement; rules in bench/gpu_traffic.rs) per optimizer step at {:.2} TB/s, L2 {:.0} MB, {:.1} us per launch:",
        bandwidth / 1e12,
        l2_bytes / 1e6,
        launch_s * 1e6
    );
    for r in &now {
        println!(
            "    {:<16} {:>8.0} launches  DRAM {:>10.3} GB  L2 {:>10.3} GB  {:>9.4} s",
            r.kernel,
            r.launches,
            r.dram_bytes / 1e9,
            r.l2_bytes / 1e9,
            r.dram_bytes / bandwidth + r.launches * launch_s
        );
    }
    let total = |rows: &[KernelTraffic]| -> (f64, f64, f64) {
        (
            rows.iter().map(|r| r.launches).sum(),
            rows.iter().map(|r| r.dram_bytes).sum(),
            rows.iter().map(|r| r.l2_bytes).sum(),
        )
    };
    let (la, da, l2a) = total(&now);
    let (lb, db, l2b) = total(&before);
    println!(
        "    modelled step {:.4} s ({:.0} launches, DRAM {:.3} GB, L2 {:.3} GB; {:.4} s with the L2 traffic at {:.1} TB/s); the round-1 kernels {:.4} s ({:.0} launches, DRAM {:.3} GB, L2 {:.3} GB; {:.4} s); measured here {:.4} s",
        modelled_s(&now, bandwidth, launch_s),
        la,
        da / 1e9,
        l2a / 1e9,
        modelled_s(&now, bandwidth, launch_s) + l2a / l2_bandwidth,
        l2_bandwidth / 1e12,
        modelled_s(&before, bandwidth, launch_s),
        lb,
        db / 1e9,
        l2b / 1e9,
        modelled_s(&before, bandwidth, launch_s) + l2b / l2_bandwidth,
        measured_s
    );
    let (bus_now, bus_before) = (
        bus_bytes(shape, Design::Current),
        bus_bytes(shape, Design::Round1),
    );
    println!(
        "    host bus per optimizer step (MODEL, at an assumed {:.0} GB/s): {:.0} bytes, {:.4} s; the round-1 engine {:.3} MB, {:.4} s, and Adam on the host",
        BUS_BYTES_PER_S / 1e9,
        bus_now,
        bus_now / BUS_BYTES_PER_S,
        bus_before / 1e6,
        bus_before / BUS_BYTES_PER_S
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Full V1 as `examples/v1_scale/config.train.json` builds it (counts from its README:
    /// 66,658 cells of 4 ports and 2 after-spike currents, 24,435,130 recurrent and 1,999,447
    /// LGN edges, 17,400 Poisson LGN nodes, delays of 1 and 2 steps, batch 16, 500 steps,
    /// chunks of 25; 85% excitatory cells live on 2 ports, the others on 3), about 2 segments
    /// per source (e and i targets), 5 Hz mean rate.
    pub(crate) fn v1() -> Shape {
        Shape {
            n: 66_658,
            ports: 4,
            live_rows: 2 * 56_660 + 3 * 9_998,
            asc: 2,
            batch: 16,
            steps: 500,
            max_delay: 2,
            e_rec: 24_435_130,
            e_in: 1_999_447,
            segments: 2 * 66_658,
            n_virtual: 17_400,
            n_poisson: 17_400,
            chunk: Some(25),
            train_in: false,
            p_spike: 0.005,
            rate_losses: 1,
        }
    }

    /// Prints full V1's model at an H200's figures (`cargo test -p lockstep-cli --release
    /// full_v1_model -- --nocapture`; the table in docs/v1-scale-performance.md).
    #[test]
    fn full_v1_model() {
        let s = v1();
        for design in [Design::Round1, Design::Current] {
            let rows = model(&s, design, 50e6);
            println!("{design:?}:");
            for r in &rows {
                println!(
                    "  {:<16} {:>6.0} launches DRAM {:>8.1} GB L2 {:>8.1} GB {:.4} s",
                    r.kernel,
                    r.launches,
                    r.dram_bytes / 1e9,
                    r.l2_bytes / 1e9,
                    r.dram_bytes / 4.8e12 + r.launches * 4e-6
                );
            }
            let l2: f64 = rows.iter().map(|r| r.l2_bytes).sum();
            println!(
                "  total {:.4} s; with the L2 traffic at 7 TB/s {:.4} s",
                modelled_s(&rows, 4.8e12, 4e-6),
                modelled_s(&rows, 4.8e12, 4e-6) + l2 / 7e12
            );
        }
    }

    /// Two launches per step each way now, three before; less DRAM traffic, and in all no
    /// more bytes (the adjoint ring moved from DRAM into L2, the atomic spike-word loads
    /// gone); full V1's modelled step within issue 57's 0.25 s at 4.8 TB/s.
    #[test]
    fn fused_kernels_launch_less_and_move_less() {
        let s = v1();
        let now = model(&s, Design::Current, 50e6);
        let before = model(&s, Design::Round1, 50e6);
        let launches = |r: &[KernelTraffic]| r.iter().map(|k| k.launches).sum::<f64>();
        // Segmented in 20 chunks: 19 of them with 2 draws before.
        // And now the parameters' and initial state's copies, the gradient's accumulation
        // and Adam on the device, and the loss sums.
        assert_eq!(
            launches(&now),
            1.0 + 2.0 * 1000.0 + 38.0 + 2.0 * 500.0 + 4.0 + 1.0
        );
        assert_eq!(launches(&before), 3.0 * 1000.0 + 38.0 + 3.0 * 500.0);
        let dram = |r: &[KernelTraffic]| r.iter().map(|k| k.dram_bytes).sum::<f64>();
        let l2 = |r: &[KernelTraffic]| r.iter().map(|k| k.l2_bytes).sum::<f64>();
        assert!(dram(&now) < 0.5 * dram(&before));
        assert!(dram(&now) + l2(&now) < dram(&before) + l2(&before));
        assert!(modelled_s(&now, 4.8e12, 4e-6) <= 0.25);
        // The any-sample bitmap (issue 57 item 3): `deliver` loads the mask word of a source
        // that fired in some sample only, about 7.7% of them at 5 Hz and batch 16; its L2
        // traffic is now mostly the input edges' (974 GB -> 257 GB).
        let deliver = |r: &[KernelTraffic]| {
            r.iter()
                .find(|k| k.kernel == "deliver")
                .map(|k| k.l2_bytes)
                .unwrap()
        };
        assert!(deliver(&now) < 0.3 * deliver(&before));
        let no_bitmap = model(&Shape { batch: 33, ..s }, Design::Current, 50e6);
        assert!(deliver(&no_bitmap) > 0.9 * deliver(&before));
        // The edge streams alone bound the step from below: 4 bytes per edge and forward
        // step (the sources), 8 per backward step.
        let floor = 4.0 * s.e_rec as f64 * (1000.0 + 2.0 * 500.0) / 4.8e12;
        assert!(modelled_s(&now, 4.8e12, 0.0) > floor);
        // The training state on the device and the initial state copied there, and the loss
        // sums reduced there: 374 MB over the bus per step before, 416 bytes now (3 sums
        // per sample, the flag, 28 bytes up), for about 1.4 GB more device traffic (0.3 ms
        // at 4.8 TB/s).
        let state: f64 = now
            .iter()
            .filter(|k| ["params copy", "accumulate", "adam"].contains(&k.kernel))
            .map(|k| k.dram_bytes)
            .sum();
        assert!((state - 56.25 * s.e_rec as f64).abs() < 1.0);
        assert!(bus_bytes(&s, Design::Round1) > 12.0 * s.e_rec as f64);
        assert_eq!(bus_bytes(&s, Design::Current), 8.0 * 3.0 * 16.0 + 32.0);
    }

    /// A random access into an array that fits the L2 is L2 traffic, not DRAM; into one
    /// that fits the L1, one fill per SM (at most the accesses' sectors).
    #[test]
    fn random_reads_of_small_arrays_stay_in_l2() {
        let mut b = Bytes::new(1e6);
        b.random(10.0, 4.0, 5e5);
        b.random(10.0, 64.0, 2e6);
        assert_eq!((b.l2, b.dram), (320.0, 640.0));
        let mut c = Bytes::new(1e6);
        c.random(1e6, 4.0, 1e4);
        assert_eq!((c.l2, c.dram), (1e4 * SMS, 0.0));
        c.random(10.0, 4.0, 1e4);
        assert_eq!(c.l2, 1e4 * SMS + 320.0);
    }
}
