//! A GPU's timeline: how the simulated GPU serves the work of several processes.
//!
//! A real GPU runs one context at a time and time-slices between the contexts that have work
//! queued: the running one keeps the GPU until its work runs out or its timeslice ends (its kernel
//! is then preempted mid-way), and the next context with work, in turn, gets the next slice. Within
//! a context, work runs in the order it was queued. So a short kernel queued beside a neighbour's
//! long backlog waits for at most one of the neighbour's slices, then shares the GPU with it slice
//! by slice until it is done.
//!
//! The model, per GPU: a *channel* per process; each queued kernel has an id (1, 2, ...: queue
//! order) and the GPU time it still needs. The running channel runs its oldest kernel until the
//! kernel is done, the channel has no work left, or its slice (`timeslice_ns`) ends while another
//! channel has work; then the next channel with work (by channel number, round robin) gets a new
//! slice, after `switch_ns` of idle GPU (a context switch). A channel alone on the GPU keeps it.
//! With a timeslice of 0 there is no slicing: kernels run in the order queued, whoever queued them.
//!
//! Under MPS the clients of one MPS server are one context to the GPU: the server's, time-sliced
//! as one against the GPU's other contexts. Inside it the clients' kernels run at the same time,
//! each channel its oldest kernel, each on its own partition of the SMs: a kernel queued needs the
//! time its partition gives it alone (the driver computes that at launch, see
//! `vgpu-sim-cuda`'s `duration`); while the running clients' partitions add up to more than the
//! GPU (70 % and 70 %), each runs at 100 / their sum of its own pace.
//!
//! Nothing is decided ahead: [`Timeline::advance`] runs the model up to a time, handing out the
//! pieces of GPU time each process got (NVML's utilisation records) and noting when kernels ended.
//! A kernel not done yet has no end time, only a prediction ([`Timeline::predict`]: the end if no
//! more work arrived), which later work can only push back.
//!
//! The timeline is plain data in the node's shared state, changed under a per-GPU lock.

/// Kernels queued on a GPU and not done, at most.
pub const PENDING: usize = 4096;
/// Kernels done whose end times are remembered (for events timed after the fact).
pub const DONE: usize = 1 << 14;
/// No channel.
const NONE: u32 = u32::MAX;

/// A queued kernel. `id == 0`: a free entry.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct Pending {
    pub id: u64,
    pub chan: u32,
    pub pid: u32,
    /// GPU time it still needs, on its partition alone.
    pub left: u64,
    /// The context it is time-sliced as (see [`Who`]).
    pub group: u32,
    /// Its channel's share of the SMs, percent.
    pub pct: u32,
}

/// Whose kernel is queued: its channel (a process), the context it is time-sliced as (an MPS
/// client's is its server's, everyone else's its own channel), its share of the SMs (an MPS
/// client's active thread percentage; 100 otherwise) and its PID.
#[derive(Clone, Copy, Debug)]
pub struct Who {
    pub chan: u32,
    pub group: u32,
    pub pct: u32,
    pub pid: u32,
}

impl Who {
    /// A process that is no MPS client: a context of its own, the whole GPU.
    pub fn alone(chan: u32, pid: u32) -> Who {
        Who { chan, group: chan, pct: 100, pid }
    }
}

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
struct Done {
    id: u64,
    end: u64,
}

/// The model's parameters.
#[derive(Clone, Copy, Debug)]
pub struct Slicing {
    /// A context's timeslice while another has work; 0: no time-slicing, every kernel in the order
    /// it was queued, whichever process queued it (a first-come GPU).
    pub timeslice_ns: u64,
    /// Idle GPU time when it switches from one context to another.
    pub switch_ns: u64,
}

/// Where the GPU is: the time simulated up to, the channel running and what is left of its slice
/// and of a context switch under way.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct Cursor {
    t: u64,
    running: u32,
    _pad: u32,
    slice_left: u64,
    switch_left: u64,
}

/// A piece of GPU time one process's kernel ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub start: u64,
    pub end: u64,
    pub pid: u32,
    /// The kernel's id.
    pub id: u64,
}

/// When a kernel ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Completion {
    /// Done at this time (0: so long ago that its time is forgotten).
    Done(u64),
    /// Not yet; it would end at this time if no more work came.
    Pending(u64),
}

#[repr(C)]
pub struct Timeline {
    cursor: Cursor,
    /// The last id given.
    last_id: u64,
    /// `pending[..npending]` are the queued kernels (in no order: a done one's place is given to
    /// the last).
    npending: u64,
    pending: [Pending; PENDING],
    done: [Done; DONE],
}

/// Whether context `c` has work queued.
fn has_work(pending: &[Pending], c: u32) -> bool {
    pending.iter().any(|p| p.id != 0 && p.group == c)
}

/// The context with work after `c`, round robin by number (the lowest after `NONE`).
fn next_after(pending: &[Pending], c: u32) -> Option<u32> {
    let chans = pending.iter().filter(|p| p.id != 0).map(|p| p.group);
    let above = chans.clone().filter(|&x| c == NONE || x > c).min();
    above.or_else(|| chans.min())
}

/// What one step of the model ran: the pieces (none: a context switch) and the kernels that ended.
type Step = (Vec<Piece>, Vec<u64>);

/// The kernels that run now in context `group`: each channel's oldest (indices into `pending`).
fn heads(pending: &[Pending], group: u32) -> Vec<usize> {
    let mut heads: Vec<usize> = Vec::new();
    for (i, p) in pending.iter().enumerate().filter(|(_, p)| p.id != 0 && p.group == group) {
        match heads.iter_mut().find(|h| pending[**h].chan == p.chan) {
            Some(h) if pending[*h].id > p.id => *h = i,
            Some(_) => {}
            None => heads.push(i),
        }
    }
    heads
}

impl Cursor {
    /// One step of the model from `self.t`, at most up to `until`, over `pending`: the pieces run
    /// (none when the step was idle: a context switch) and the ids of the kernels that ended with
    /// it. `None` overall when there is nothing to do before `until`.
    fn step(&mut self, pending: &mut [Pending], until: u64, s: Slicing) -> Option<Step> {
        if self.t >= until {
            return None;
        }
        // Time-sliced: one context's kernels at a time, for a slice each. Not: every kernel in the
        // order queued, whoever queued it.
        let sliced = s.timeslice_ns > 0;
        if sliced && (self.running == NONE || !has_work(pending, self.running)) {
            let next = next_after(pending, self.running)?;
            if self.running != NONE {
                self.switch_left = s.switch_ns;
            }
            self.running = next;
            self.slice_left = s.timeslice_ns;
        }
        if self.switch_left > 0 {
            let d = self.switch_left.min(until - self.t);
            self.t += d;
            self.switch_left -= d;
            return Some((Vec::new(), Vec::new()));
        }
        let group =
            if sliced { self.running } else { pending.iter().filter(|p| p.id != 0).min_by_key(|p| p.id)?.group };
        let others = sliced && pending.iter().any(|p| p.id != 0 && p.group != group);
        let heads = heads(pending, group);
        // Partitions that add up to more than the GPU share it.
        let load = heads.iter().map(|&h| u64::from(pending[h].pct.clamp(1, 100))).sum::<u64>().max(100);
        let to_end = heads.iter().map(|&h| (pending[h].left * load).div_ceil(100)).min()?;
        let run = to_end.min(until - self.t).min(if others { self.slice_left.max(1) } else { u64::MAX });
        let progress = (run * 100).div_ceil(load);
        let (mut pieces, mut ended) = (Vec::with_capacity(heads.len()), Vec::new());
        for h in heads {
            let k = &mut pending[h];
            pieces.push(Piece { start: self.t, end: self.t + run, pid: k.pid, id: k.id });
            k.left -= progress.min(k.left);
            if k.left == 0 {
                ended.push(std::mem::take(k).id);
            }
        }
        self.t += run;
        if sliced {
            self.slice_left = self.slice_left.saturating_sub(run);
        }
        if sliced && self.slice_left == 0 {
            // The slice is over: the next context with work (this one again when alone).
            self.slice_left = s.timeslice_ns;
            if others {
                if let Some(n) = next_after(pending, group).filter(|&n| n != group) {
                    self.running = n;
                    self.switch_left = s.switch_ns;
                }
            }
        }
        Some((pieces, ended))
    }
}

impl Timeline {
    /// Queues `dur_ns` of work of `who` at `now`; its id, or None when the queue is full (the
    /// caller waits, as a driver's launch blocks on a full queue).
    pub fn enqueue(&mut self, now: u64, who: Who, dur_ns: u64, s: Slicing, out: impl FnMut(Piece)) -> Option<u64> {
        self.advance(now, s, out);
        let n = self.npending as usize;
        if n == PENDING {
            return None;
        }
        self.last_id += 1;
        let Who { chan, group, pct, pid } = who;
        self.pending[n] = Pending { id: self.last_id, chan, pid, left: dur_ns.max(1), group, pct };
        self.npending += 1;
        Some(self.last_id)
    }

    /// The queued kernels.
    fn queued(&mut self) -> &mut [Pending] {
        &mut self.pending[..self.npending as usize]
    }

    /// Notes kernel `id` (whose entry was emptied) ended at `end`, and gives its place to the last.
    fn retire(&mut self, id: u64, end: u64) {
        self.done[(id % DONE as u64) as usize] = Done { id, end };
        if let Some(i) = self.queued().iter().position(|p| p.id == 0) {
            let last = self.npending as usize - 1;
            self.pending.swap(i, last);
            self.pending[last] = Pending::default();
            self.npending -= 1;
        }
    }

    /// Runs the model up to `now`, handing each piece of GPU time run to `out`.
    pub fn advance(&mut self, now: u64, s: Slicing, mut out: impl FnMut(Piece)) {
        while self.npending > 0 {
            let mut c = self.cursor;
            let Some((pieces, ended)) = c.step(self.queued(), now, s) else { break };
            self.cursor = c;
            pieces.into_iter().for_each(&mut out);
            for id in ended {
                self.retire(id, self.cursor.t);
            }
        }
        if self.npending == 0 {
            // Idle: nothing runs, and a context that comes next starts without a switch.
            self.cursor.t = self.cursor.t.max(now);
            self.cursor.running = NONE;
            self.cursor.switch_left = 0;
        }
    }

    /// When kernel `id` ends, as the model stands (call [`Timeline::advance`] first).
    pub fn completion(&self, id: u64, s: Slicing) -> Completion {
        let d = self.done[(id % DONE as u64) as usize];
        if id == 0 || d.id == id {
            return Completion::Done(if id == 0 { 0 } else { d.end });
        }
        if !self.pending[..self.npending as usize].iter().any(|p| p.id == id) {
            return Completion::Done(0);
        }
        Completion::Pending(self.predict(id, s))
    }

    /// When kernel `id` (pending) would end if no more work came.
    fn predict(&self, id: u64, s: Slicing) -> u64 {
        let mut pending: Vec<Pending> = self.pending[..self.npending as usize].to_vec();
        let mut c = self.cursor;
        while let Some((_, ended)) = c.step(&mut pending, u64::MAX, s) {
            if ended.contains(&id) {
                return c.t;
            }
            if !ended.is_empty() {
                pending.retain(|p| p.id != 0);
            }
        }
        c.t
    }

    /// Drops the queued work of channel `chan` (its process is gone, and a driver tears its
    /// context down with it), as ended at `now`.
    pub fn drop_channel(&mut self, chan: u32, now: u64) {
        while let Some(p) = self.queued().iter_mut().find(|p| p.chan == chan) {
            let id = std::mem::take(p).id;
            self.retire(id, now);
        }
        if self.npending == 0 {
            self.cursor.running = NONE;
            self.cursor.switch_left = 0;
        }
    }

    /// Drops every queued kernel, as ended at `now`.
    pub fn clear(&mut self, now: u64) {
        while self.npending > 0 {
            let id = std::mem::take(&mut self.pending[0]).id;
            self.retire(id, now);
        }
        self.cursor.running = NONE;
        self.cursor.switch_left = 0;
    }

    /// Kernels queued and not done.
    pub fn pending(&self) -> u64 {
        self.npending
    }

    /// A fresh timeline (the shared one starts zeroed, and [`Timeline::init`] makes it the same).
    #[cfg(test)]
    fn boxed() -> Box<Timeline> {
        // SAFETY: every field is an integer or an array of integers: all zeroes is a valid value,
        // and the one `Timeline::default` would build (an idle GPU at time 0, nothing queued).
        let mut t: Box<Timeline> = unsafe { Box::new_zeroed().assume_init() };
        t.cursor.running = NONE;
        t
    }

    /// Makes a zeroed timeline (the shared state's initial bytes) a valid idle one.
    pub fn init(&mut self) {
        self.cursor.running = NONE;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const S: Slicing = Slicing { timeslice_ns: 2 * MS, switch_ns: 0 };

    fn run(t: &mut Timeline, now: u64) -> Vec<Piece> {
        let mut v = Vec::new();
        t.advance(now, S, |p| v.push(p));
        v
    }

    #[test]
    fn a_context_alone_runs_its_kernels_back_to_back() {
        let mut t = Timeline::boxed();
        let a = t.enqueue(10, Who::alone(0, 100), 3 * MS, S, |_| {}).unwrap();
        let b = t.enqueue(10, Who::alone(0, 100), MS, S, |_| {}).unwrap();
        assert_eq!(t.completion(a, S), Completion::Pending(10 + 3 * MS));
        assert_eq!(t.completion(b, S), Completion::Pending(10 + 4 * MS));
        let pieces = run(&mut t, 10 + 5 * MS);
        assert_eq!(pieces.iter().map(|p| p.end - p.start).sum::<u64>(), 4 * MS);
        assert_eq!(t.completion(a, S), Completion::Done(10 + 3 * MS));
        assert_eq!(t.completion(b, S), Completion::Done(10 + 4 * MS));
        assert_eq!(t.pending(), 0);
    }

    #[test]
    fn a_short_kernel_beside_a_backlog_waits_one_slice_then_shares() {
        let mut t = Timeline::boxed();
        // A best-effort backlog: 20 kernels of 5 ms on channel 1.
        let backlog: Vec<u64> = (0..20).map(|_| t.enqueue(0, Who::alone(1, 200), 5 * MS, S, |_| {}).unwrap()).collect();
        // 1 ms in, a 1 ms kernel on channel 0: it waits for the rest of channel 1's slice (1 ms).
        run(&mut t, MS);
        let k = t.enqueue(MS, Who::alone(0, 100), MS, S, |_| {}).unwrap();
        assert_eq!(t.completion(k, S), Completion::Pending(3 * MS), "queued behind one slice, not 100 ms");
        // The backlog's first kernel is pushed back by the 1 ms it lost.
        assert_eq!(t.completion(backlog[0], S), Completion::Pending(6 * MS));
        let pieces = run(&mut t, 10 * MS);
        assert_eq!(t.completion(k, S), Completion::Done(3 * MS));
        assert_eq!(pieces[0], Piece { start: MS, end: 2 * MS, pid: 200, id: backlog[0] });
        assert_eq!(pieces[1], Piece { start: 2 * MS, end: 3 * MS, pid: 100, id: k });
        // Busy the whole time: the GPU never idles while work is queued.
        assert_eq!(pieces.iter().map(|p| p.end - p.start).sum::<u64>(), 9 * MS);
    }

    #[test]
    fn two_busy_contexts_alternate_slices_and_a_switch_costs_idle_time() {
        let s = Slicing { timeslice_ns: 2 * MS, switch_ns: MS / 10 };
        let mut t = Timeline::boxed();
        let a = t.enqueue(0, Who::alone(3, 1), 10 * MS, s, |_| {}).unwrap();
        let b = t.enqueue(0, Who::alone(5, 2), 10 * MS, s, |_| {}).unwrap();
        let mut v = Vec::new();
        t.advance(100 * MS, s, |p| v.push(p));
        let per = |pid| v.iter().filter(|p| p.pid == pid).map(|p| p.end - p.start).sum::<u64>();
        assert_eq!((per(1), per(2)), (10 * MS, 10 * MS));
        assert!(v.iter().all(|p| p.end - p.start <= 2 * MS), "{v:?}");
        // Nine switches of 0.1 ms before the last slices: a ends at 18.8 ms, b at 20.9 ms.
        let (Completion::Done(ea), Completion::Done(eb)) = (t.completion(a, s), t.completion(b, s)) else {
            panic!("both done")
        };
        assert_eq!((ea, eb), (18 * MS + 8 * MS / 10, 20 * MS + 9 * MS / 10));
    }

    #[test]
    fn without_slicing_kernels_run_in_the_order_queued() {
        let fifo = Slicing { timeslice_ns: 0, switch_ns: 0 };
        let mut t = Timeline::boxed();
        let backlog: Vec<u64> =
            (0..20).map(|_| t.enqueue(0, Who::alone(1, 200), 5 * MS, fifo, |_| {}).unwrap()).collect();
        let k = t.enqueue(MS, Who::alone(0, 100), MS, fifo, |_| {}).unwrap();
        assert_eq!(t.completion(k, fifo), Completion::Pending(101 * MS), "behind the whole backlog");
        assert_eq!(t.completion(backlog[19], fifo), Completion::Pending(100 * MS));
    }

    #[test]
    fn a_gone_process_s_work_is_dropped_and_the_rest_runs_on() {
        let mut t = Timeline::boxed();
        let a = t.enqueue(0, Who::alone(1, 10), 50 * MS, S, |_| {}).unwrap();
        let b = t.enqueue(0, Who::alone(2, 20), MS, S, |_| {}).unwrap();
        run(&mut t, MS);
        t.drop_channel(1, MS);
        assert_eq!(t.completion(a, S), Completion::Done(MS));
        assert_eq!(t.completion(b, S), Completion::Pending(2 * MS), "alone now: at once");
    }

    #[test]
    fn a_full_queue_refuses_and_old_ends_are_remembered() {
        let mut t = Timeline::boxed();
        for _ in 0..PENDING {
            t.enqueue(0, Who::alone(0, 1), 1000, S, |_| {}).unwrap();
        }
        assert_eq!(t.enqueue(0, Who::alone(0, 1), 1000, S, |_| {}), None);
        run(&mut t, 1000);
        assert_eq!(t.completion(1, S), Completion::Done(1000));
        assert!(t.enqueue(1000, Who::alone(0, 1), 1000, S, |_| {}).is_some(), "room again");
        assert_eq!(t.completion(0, S), Completion::Done(0), "no kernel: nothing to wait for");
    }

    /// An MPS client of the server in channel 9.
    fn client(chan: u32, pct: u32) -> Who {
        Who { chan, group: 9, pct, pid: 100 + chan }
    }

    fn ends(t: &Timeline, ids: &[u64]) -> Vec<u64> {
        ids.iter()
            .map(|&id| match t.completion(id, S) {
                Completion::Done(e) => e,
                c => panic!("{id} not done: {c:?}"),
            })
            .collect()
    }

    #[test]
    fn mps_clients_within_the_gpu_run_at_once_each_on_its_partition() {
        let mut t = Timeline::boxed();
        // 30 % and 70 %: each kernel's time is what its partition needs alone; together they fit.
        let a = t.enqueue(0, client(1, 30), 10 * MS, S, |_| {}).unwrap();
        let b = t.enqueue(0, client(2, 70), 4 * MS, S, |_| {}).unwrap();
        let b2 = t.enqueue(0, client(2, 70), 4 * MS, S, |_| {}).unwrap();
        let pieces = run(&mut t, 20 * MS);
        assert_eq!(ends(&t, &[a, b, b2]), [10 * MS, 4 * MS, 8 * MS], "no slicing between clients");
        let per = |pid| pieces.iter().filter(|p| p.pid == pid).map(|p| p.end - p.start).sum::<u64>();
        assert_eq!((per(101), per(102)), (10 * MS, 8 * MS), "each client's time is its own");
    }

    #[test]
    fn mps_partitions_over_the_gpu_share_it() {
        let mut t = Timeline::boxed();
        // 70 % and 70 %: 140 % asked of the GPU, so each runs at 100/140 of its pace while both run.
        let a = t.enqueue(0, client(1, 70), 7 * MS, S, |_| {}).unwrap();
        let b = t.enqueue(0, client(2, 70), 14 * MS, S, |_| {}).unwrap();
        assert_eq!(t.completion(a, S), Completion::Pending(98 * MS / 10));
        run(&mut t, 30 * MS);
        // a: 7 ms of work at 1/1.4 speed ends at 9.8 ms; b has 7 ms left then, alone: 16.8 ms.
        assert_eq!(ends(&t, &[a, b]), [98 * MS / 10, 168 * MS / 10]);
    }

    #[test]
    fn an_mps_server_is_one_context_time_sliced_against_the_others() {
        let mut t = Timeline::boxed();
        // A process of its own (channel 3) with a long kernel, and two MPS clients: the clients run
        // together in the server's slices, the process in its own.
        let p = t.enqueue(0, Who::alone(3, 50), 4 * MS, S, |_| {}).unwrap();
        let a = t.enqueue(0, client(1, 50), 2 * MS, S, |_| {}).unwrap();
        let b = t.enqueue(0, client(2, 50), 2 * MS, S, |_| {}).unwrap();
        run(&mut t, 20 * MS);
        // Channel 3 first (the lowest context), a slice of 2 ms; then the server's context runs both
        // clients for 2 ms; then channel 3 finishes.
        assert_eq!(ends(&t, &[a, b, p]), [4 * MS, 4 * MS, 6 * MS]);
    }
}
