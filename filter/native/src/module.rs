//! One filter configuration of the module: its workers' slots, the clock
//! that ticks them, the streams waiting for a word from a tick, and the
//! calls out to the admin ([`crate::workers`] drives the workers).
//!
//! Threads. Envoy runs each stream's hooks on one worker thread; each
//! worker thread has its own [`Worker`] (as each has its own wasm VM),
//! and a further one, slot 0, is made with the configuration so that the
//! Envoy syncs with the admin before its first request. Every worker's
//! tick runs on Envoy's main thread, woken through the configuration's
//! scheduler by [`Ticker`]'s thread: the main thread is where the
//! configuration's HTTP callouts may be made, and ticking there needs no
//! stream alive on a worker. What a tick decides for a stream (resume it,
//! reply, set its route header) is posted to that stream's own
//! scheduler and carried out on its thread.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustc_hash::FxHashMap;
use sluice_filter::shared_memory::SharedMemory;
use sluice_filter::stream_shell::ShellSettings;
use sluice_filter::worker::Worker;
use sluice_filter_core::plugin::PluginConfig;

use crate::abi::{self, EnvoyPtr};
use crate::stats::Stats;

/// Shared data of the whole process, as proxy-wasm's is for one VM id:
/// every configuration's workers count against the same limits.
pub static MEMORY: LazyLock<SharedMemory> = LazyLock::new(SharedMemory::default);

/// Stream context ids, unique in the process.
static NEXT_CONTEXT: AtomicU32 = AtomicU32::new(1);

/// Each configuration's number, never given twice in a process (an
/// address is: a configuration made after a reload may sit where a
/// destroyed one was).
static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

pub fn next_context_id() -> u32 {
    NEXT_CONTEXT.fetch_add(1, Ordering::Relaxed)
}

/// One worker and when it wants its next tick.
pub struct Slot {
    pub index: usize,
    worker: Mutex<Worker>,
    /// Its tick period and its next tick, in nanoseconds since the epoch.
    pub period_ns: AtomicU64,
    pub due_ns: AtomicU64,
}

impl Slot {
    pub fn new(index: usize, worker: Worker) -> Self {
        Self {
            index,
            worker: Mutex::new(worker),
            period_ns: AtomicU64::new(0),
            due_ns: AtomicU64::new(0),
        }
    }

    pub fn worker(&self) -> MutexGuard<'_, Worker> {
        // A panic while a worker was held is caught at the hook; its state
        // is as the panic left it, as a wasm VM's is until it reloads.
        self.worker.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What a tick asks of a stream on another thread.
#[derive(Debug)]
pub enum Posted {
    SetHeader(String, String),
    /// A decision field for the access log (`sluice` dynamic metadata).
    LogField(&'static str, String),
    Resume,
    Reply {
        status: u32,
        headers: Vec<(String, String)>,
        body: Vec<u8>,
    },
}

/// A waiting stream's scheduler and what was posted to it.
struct Mailbox {
    scheduler: usize,
    posted: Vec<Posted>,
}

pub struct Module {
    /// Envoy's configuration (its pointer).
    config: usize,
    pub settings: PluginConfig,
    pub stats: Stats,
    slots: Mutex<Vec<Arc<Slot>>>,
    mailboxes: Mutex<FxHashMap<u32, Mailbox>>,
    /// Calls out to the admin: callout id to (slot, worker's token).
    callouts: Mutex<FxHashMap<u64, (usize, u32)>>,
    next_token: AtomicU32,
    ticker: Arc<Ticker>,
    pub shell: ShellSettings,
    /// This configuration's number ([`NEXT_GENERATION`]): what a worker
    /// thread's cached slot is keyed by.
    pub generation: u64,
}

impl Module {
    /// # Safety
    /// `config` must be the configuration Envoy is creating; stats are
    /// defined with it now, the only time Envoy takes definitions.
    pub unsafe fn new(config: EnvoyPtr, settings: PluginConfig) -> Arc<Self> {
        // SAFETY: the caller's promise.
        let stats = unsafe { Stats::define_all(config) };
        // SAFETY: as above.
        let scheduler =
            unsafe { abi::envoy_dynamic_module_callback_http_filter_config_scheduler_new(config) };
        Arc::new(Self {
            config: config as usize,
            shell: ShellSettings::of(&settings),
            generation: NEXT_GENERATION.fetch_add(1, Ordering::Relaxed),
            settings,
            stats,
            slots: Mutex::new(Vec::new()),
            mailboxes: Mutex::new(FxHashMap::default()),
            callouts: Mutex::new(FxHashMap::default()),
            next_token: AtomicU32::new(1),
            ticker: Arc::new(Ticker::new(scheduler as usize)),
        })
    }

    pub fn config(&self) -> EnvoyPtr {
        self.config as EnvoyPtr
    }

    /// Worker `index`'s slot, made with `make`'s worker if it has none
    /// yet (under the slots' lock: one worker per index); true if made.
    pub fn slot_or_make(&self, index: usize, make: impl FnOnce() -> Worker) -> (Arc<Slot>, bool) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = slots.iter().find(|s| s.index == index) {
            return (Arc::clone(slot), false);
        }
        let slot = Arc::new(Slot::new(index, make()));
        slots.push(Arc::clone(&slot));
        (slot, true)
    }

    /// Every slot made so far.
    pub fn slots(&self) -> Vec<Arc<Slot>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The ticker starts waking the main thread for this configuration.
    pub fn start_ticker(self: &Arc<Self>) {
        self.ticker.start(Arc::downgrade(self));
    }

    /// The main thread took the ticker's wake-up.
    pub fn woken(&self) {
        self.ticker.pending.store(false, Ordering::Release);
    }

    fn earliest_due(&self) -> u64 {
        self.slots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|s| s.due_ns.load(Ordering::Acquire))
            .min()
            .unwrap_or(u64::MAX)
    }

    pub fn wake_ticker(&self) {
        self.ticker.wake();
    }

    /// Gives waiting stream `context_id` a scheduler to be woken through.
    ///
    /// # Safety
    /// `filter` must be the stream's, on its own thread.
    pub unsafe fn open_mailbox(&self, context_id: u32, filter: EnvoyPtr) {
        let mut boxes = self.mailboxes.lock().unwrap_or_else(|e| e.into_inner());
        if boxes.contains_key(&context_id) {
            return;
        }
        // SAFETY: the caller's promise.
        let scheduler =
            unsafe { abi::envoy_dynamic_module_callback_http_filter_scheduler_new(filter) };
        boxes.insert(
            context_id,
            Mailbox {
                scheduler: scheduler as usize,
                posted: Vec::new(),
            },
        );
    }

    /// Posts to waiting stream `context_id`; false when it has no mailbox
    /// (gone, or never waited).
    pub fn post_to(&self, context_id: u32, posted: Posted) -> bool {
        let mut boxes = self.mailboxes.lock().unwrap_or_else(|e| e.into_inner());
        let Some(mailbox) = boxes.get_mut(&context_id) else {
            return false;
        };
        mailbox.posted.push(posted);
        // SAFETY: the scheduler lives until the mailbox is closed, which
        // takes this lock.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_scheduler_commit(
                mailbox.scheduler as EnvoyPtr,
                u64::from(context_id),
            );
        }
        true
    }

    /// What was posted to stream `context_id`, in order.
    pub fn take_posted(&self, context_id: u32) -> Vec<Posted> {
        let mut boxes = self.mailboxes.lock().unwrap_or_else(|e| e.into_inner());
        boxes
            .get_mut(&context_id)
            .map(|m| std::mem::take(&mut m.posted))
            .unwrap_or_default()
    }

    pub fn close_mailbox(&self, context_id: u32) {
        let mut boxes = self.mailboxes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(mailbox) = boxes.remove(&context_id) {
            // SAFETY: made by `open_mailbox`, deleted once, under the lock
            // `post` commits under.
            unsafe {
                abi::envoy_dynamic_module_callback_http_filter_scheduler_delete(
                    mailbox.scheduler as EnvoyPtr,
                )
            };
        }
    }

    /// Sends an HTTP call through `cluster`; on the main thread only.
    pub fn call_out(
        &self,
        slot: usize,
        cluster: &str,
        headers: &[(&str, &str)],
        body: &[u8],
        timeout_ms: u64,
    ) -> Option<u32> {
        let headers: Vec<abi::ModuleHeader> = headers
            .iter()
            .map(|(k, v)| abi::ModuleHeader {
                key: abi::ModuleBuffer::of(k.as_bytes()),
                value: abi::ModuleBuffer::of(v.as_bytes()),
            })
            .collect();
        let mut id = 0u64;
        // SAFETY: the configuration is live while its module is; every
        // buffer lives through the call.
        let result = unsafe {
            abi::envoy_dynamic_module_callback_http_filter_config_http_callout(
                self.config(),
                &mut id,
                abi::ModuleBuffer::of(cluster.as_bytes()),
                headers.as_ptr(),
                headers.len(),
                abi::ModuleBuffer::of(body),
                timeout_ms,
            )
        };
        if result != abi::CALLOUT_INIT_SUCCESS {
            return None;
        }
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        self.callouts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, (slot, token));
        Some(token)
    }

    /// The slot index and token of callout `id`, once.
    pub fn take_callout(&self, id: u64) -> Option<(usize, u32)> {
        self.callouts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id)
    }

    /// Stops the ticker; the configuration is going.
    pub fn shut_down(&self) {
        self.ticker.stop();
    }
}

/// The shortest tick period the module keeps (a millisecond, the queue's).
pub const MIN_TICK_NS: u64 = 1_000_000;

pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// The thread that wakes the main thread when a worker's tick is due.
struct Ticker {
    scheduler: usize,
    /// A wake-up is on its way to the main thread.
    pending: AtomicBool,
    state: Mutex<TickerState>,
    changed: Condvar,
}

#[derive(Default)]
struct TickerState {
    stopped: bool,
    thread: Option<JoinHandle<()>>,
}

/// The longest the thread sleeps without looking again.
const MAX_SLEEP: Duration = Duration::from_millis(100);

impl Ticker {
    fn new(scheduler: usize) -> Self {
        Self {
            scheduler,
            pending: AtomicBool::new(false),
            state: Mutex::new(TickerState::default()),
            changed: Condvar::new(),
        }
    }

    fn start(self: &Arc<Self>, module: Weak<Module>) {
        let ticker = Arc::clone(self);
        let thread = std::thread::Builder::new()
            .name("sluice-ticker".into())
            .spawn(move || ticker.run(&module));
        if let Ok(thread) = thread {
            self.state.lock().unwrap_or_else(|e| e.into_inner()).thread = Some(thread);
        }
    }

    /// Taken under the lock the thread decides under: a wake-up between
    /// its look and its wait cannot be lost.
    fn wake(&self) {
        let _state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.changed.notify_all();
    }

    fn stop(&self) {
        let thread = {
            let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            state.stopped = true;
            state.thread.take()
        };
        self.changed.notify_all();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
        // SAFETY: made in `Module::new`; the thread that committed to it
        // has ended.
        unsafe {
            abi::envoy_dynamic_module_callback_http_filter_config_scheduler_delete(
                self.scheduler as EnvoyPtr,
            )
        };
    }

    fn run(&self, module: &Weak<Module>) {
        loop {
            let Some(earliest) = module.upgrade().map(|m| m.earliest_due()) else {
                return;
            };
            let now = now_ns();
            let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if state.stopped {
                return;
            }
            if earliest <= now && !self.pending.swap(true, Ordering::AcqRel) {
                // SAFETY: the scheduler lives until `stop`, which waits
                // for this thread.
                unsafe {
                    abi::envoy_dynamic_module_callback_http_filter_config_scheduler_commit(
                        self.scheduler as EnvoyPtr,
                        0,
                    );
                }
            }
            // Until the main thread has ticked, or the next tick is due.
            let sleep = if self.pending.load(Ordering::Acquire) {
                MAX_SLEEP
            } else {
                Duration::from_nanos(earliest.saturating_sub(now)).min(MAX_SLEEP)
            };
            let _ = self.changed.wait_timeout(state, sleep);
        }
    }
}
