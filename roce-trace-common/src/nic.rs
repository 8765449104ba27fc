//! NIC and PFC counters: one vocabulary for every driver, and what a change between two
//! reads means.
//!
//! Pause frames never reach XDP or TC (the MAC consumes them), and an RDMA NIC handles
//! RoCE data and CNPs itself: a port's counters are the host's only evidence of PFC and
//! of the NIC's congestion control. They are observations of a port, not of a packet.
//!
//! The canonical names are mlx5's (`drivers/infiniband/hw/mlx5/counters.c`, the
//! `hw_counters` of an RDMA port; `Documentation/networking/device_drivers/ethernet/
//! mellanox/mlx5/counters.rst`, the netdev's ethtool statistics). Other drivers map onto
//! them through [`alias`]. A counter a port does not have is [`Missing`] with a reason,
//! never 0.

use core::fmt;

/// Where a counter is read: the netdev's ethtool statistics or the RDMA port's
/// `hw_counters`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Source {
    Ethtool,
    Rdma,
}

/// What a counter counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Unit {
    Packets,
    Bytes,
    /// Pause time, in microseconds.
    Micros,
    Events,
}

impl Unit {
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Packets => "packets",
            Unit::Bytes => "bytes",
            Unit::Micros => "microseconds",
            Unit::Events => "events",
        }
    }
}

/// Received or transmitted, for the port counters that have a direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dir {
    Rx,
    Tx,
}

impl Dir {
    pub fn as_str(self) -> &'static str {
        match self {
            Dir::Rx => "rx",
            Dir::Tx => "tx",
        }
    }
}

/// A canonical counter, without its priority. The discriminant is its code on the wire
/// (the NIC frame): append new kinds, never reorder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Kind {
    // Per priority (ethtool).
    RxPause,
    TxPause,
    RxPauseDuration,
    TxPauseDuration,
    RxPauseTransition,
    TxPauseTransition,
    RxPrioPackets,
    TxPrioPackets,
    RxPrioBytes,
    TxPrioBytes,
    RxPrioMarked,
    RxPrioDiscards,
    // Port (ethtool).
    RxPauseCtrlPhy,
    TxPauseCtrlPhy,
    TxPauseStormWarning,
    TxPauseStormError,
    RxDiscardsPhy,
    TxDiscardsPhy,
    RxVportRdmaPackets,
    TxVportRdmaPackets,
    RxVportRdmaBytes,
    TxVportRdmaBytes,
    // RDMA port (hw_counters).
    NpCnpSent,
    NpEcnMarkedRocePackets,
    RpCnpHandled,
    RpCnpIgnored,
    OutOfSequence,
    PacketSeqErr,
    ImpliedNakSeqErr,
    LocalAckTimeoutErr,
    DuplicateRequest,
    RnrNakRetryErr,
    ReqTransportRetriesExceeded,
    ReqRnrRetriesExceeded,
    OutOfBuffer,
    RxIcrcEncapsulated,
    /// mlx5's optional counters: off until `rdma statistic set … optional-counters`, and
    /// then read through RDMA netlink, not sysfs.
    CcRxCePkts,
    CcRxCnpPkts,
    CcTxCnpPkts,
}

/// What one kind is: its canonical name (with `{p}` for the priority), where it is read,
/// its unit and direction, and its Prometheus metric.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    pub kind: Kind,
    /// The canonical name's text before the priority digit (or the whole name).
    pub prefix: &'static str,
    /// After the priority digit; `None` for a counter without a priority.
    pub suffix: Option<&'static str>,
    pub source: Source,
    pub unit: Unit,
    pub dir: Option<Dir>,
    /// The Prometheus metric (without `roce_trace_`), labelled by direction and priority
    /// where the counter has them.
    pub metric: &'static str,
    pub help: &'static str,
    /// Off until enabled (mlx5's optional counters).
    pub optional: bool,
}

#[allow(clippy::too_many_arguments)]
const fn s(
    kind: Kind,
    prefix: &'static str,
    suffix: Option<&'static str>,
    source: Source,
    unit: Unit,
    dir: Option<Dir>,
    metric: &'static str,
    help: &'static str,
) -> Spec {
    Spec {
        kind,
        prefix,
        suffix,
        source,
        unit,
        dir,
        metric,
        help,
        optional: false,
    }
}

use Dir::{Rx, Tx};
use Source::{Ethtool as E, Rdma as R};
use Unit::{Bytes, Events, Micros, Packets};

/// Every canonical kind, in the order reports list them.
pub const SPECS: &[Spec] = &[
    s(
        Kind::RxPause,
        "rx_prio",
        Some("_pause"),
        E,
        Packets,
        Some(Rx),
        "nic_pfc_pause_frames_total",
        "PFC pause frames per priority (mlx5 rx/tx_prio{p}_pause)",
    ),
    s(
        Kind::TxPause,
        "tx_prio",
        Some("_pause"),
        E,
        Packets,
        Some(Tx),
        "nic_pfc_pause_frames_total",
        "PFC pause frames per priority (mlx5 rx/tx_prio{p}_pause)",
    ),
    s(
        Kind::RxPauseDuration,
        "rx_prio",
        Some("_pause_duration"),
        E,
        Micros,
        Some(Rx),
        "nic_pfc_pause_duration_microseconds_total",
        "time paused per priority, microseconds (mlx5 rx/tx_prio{p}_pause_duration)",
    ),
    s(
        Kind::TxPauseDuration,
        "tx_prio",
        Some("_pause_duration"),
        E,
        Micros,
        Some(Tx),
        "nic_pfc_pause_duration_microseconds_total",
        "time paused per priority, microseconds (mlx5 rx/tx_prio{p}_pause_duration)",
    ),
    s(
        Kind::RxPauseTransition,
        "rx_prio",
        Some("_pause_transition"),
        E,
        Events,
        Some(Rx),
        "nic_pfc_pause_transitions_total",
        "pause to unpause transitions per priority (mlx5 rx_prio{p}_pause_transition)",
    ),
    s(
        Kind::TxPauseTransition,
        "tx_prio",
        Some("_pause_transition"),
        E,
        Events,
        Some(Tx),
        "nic_pfc_pause_transitions_total",
        "pause to unpause transitions per priority (mlx5 rx_prio{p}_pause_transition)",
    ),
    s(
        Kind::RxPrioPackets,
        "rx_prio",
        Some("_packets"),
        E,
        Packets,
        Some(Rx),
        "nic_priority_packets_total",
        "packets per priority (mlx5 rx/tx_prio{p}_packets)",
    ),
    s(
        Kind::TxPrioPackets,
        "tx_prio",
        Some("_packets"),
        E,
        Packets,
        Some(Tx),
        "nic_priority_packets_total",
        "packets per priority (mlx5 rx/tx_prio{p}_packets)",
    ),
    s(
        Kind::RxPrioBytes,
        "rx_prio",
        Some("_bytes"),
        E,
        Bytes,
        Some(Rx),
        "nic_priority_bytes_total",
        "bytes per priority (mlx5 rx/tx_prio{p}_bytes)",
    ),
    s(
        Kind::TxPrioBytes,
        "tx_prio",
        Some("_bytes"),
        E,
        Bytes,
        Some(Tx),
        "nic_priority_bytes_total",
        "bytes per priority (mlx5 rx/tx_prio{p}_bytes)",
    ),
    s(
        Kind::RxPrioMarked,
        "rx_prio",
        Some("_marked"),
        E,
        Packets,
        Some(Rx),
        "nic_priority_ecn_marked_packets_total",
        "packets the NIC marked ECN for host congestion, per priority (mlx5 rx_prio{p}_marked)",
    ),
    s(
        Kind::RxPrioDiscards,
        "rx_prio",
        Some("_discards"),
        E,
        Packets,
        Some(Rx),
        "nic_priority_discards_total",
        "received packets discarded per priority (mlx5 rx_prio{p}_discards)",
    ),
    s(
        Kind::RxPauseCtrlPhy,
        "rx_pause_ctrl_phy",
        None,
        E,
        Packets,
        Some(Rx),
        "nic_pause_ctrl_frames_total",
        "link-level pause control frames, all priorities (mlx5 rx/tx_pause_ctrl_phy)",
    ),
    s(
        Kind::TxPauseCtrlPhy,
        "tx_pause_ctrl_phy",
        None,
        E,
        Packets,
        Some(Tx),
        "nic_pause_ctrl_frames_total",
        "link-level pause control frames, all priorities (mlx5 rx/tx_pause_ctrl_phy)",
    ),
    s(
        Kind::TxPauseStormWarning,
        "tx_pause_storm_warning_events",
        None,
        E,
        Events,
        Some(Tx),
        "nic_pause_storm_warning_events_total",
        "the NIC sent pause for longer than the storm warning threshold (mlx5 tx_pause_storm_warning_events)",
    ),
    s(
        Kind::TxPauseStormError,
        "tx_pause_storm_error_events",
        None,
        E,
        Events,
        Some(Tx),
        "nic_pause_storm_error_events_total",
        "the storm watchdog stopped the NIC sending pause (mlx5 tx_pause_storm_error_events)",
    ),
    s(
        Kind::RxDiscardsPhy,
        "rx_discards_phy",
        None,
        E,
        Packets,
        Some(Rx),
        "nic_discards_phy_total",
        "packets the port discarded, rx: no buffer, tx: head of line (mlx5 rx/tx_discards_phy)",
    ),
    s(
        Kind::TxDiscardsPhy,
        "tx_discards_phy",
        None,
        E,
        Packets,
        Some(Tx),
        "nic_discards_phy_total",
        "packets the port discarded, rx: no buffer, tx: head of line (mlx5 rx/tx_discards_phy)",
    ),
    s(
        Kind::RxVportRdmaPackets,
        "rx_vport_rdma_unicast_packets",
        None,
        E,
        Packets,
        Some(Rx),
        "nic_rdma_unicast_packets_total",
        "RDMA unicast packets (mlx5 rx/tx_vport_rdma_unicast_packets)",
    ),
    s(
        Kind::TxVportRdmaPackets,
        "tx_vport_rdma_unicast_packets",
        None,
        E,
        Packets,
        Some(Tx),
        "nic_rdma_unicast_packets_total",
        "RDMA unicast packets (mlx5 rx/tx_vport_rdma_unicast_packets)",
    ),
    s(
        Kind::RxVportRdmaBytes,
        "rx_vport_rdma_unicast_bytes",
        None,
        E,
        Bytes,
        Some(Rx),
        "nic_rdma_unicast_bytes_total",
        "RDMA unicast bytes (mlx5 rx/tx_vport_rdma_unicast_bytes)",
    ),
    s(
        Kind::TxVportRdmaBytes,
        "tx_vport_rdma_unicast_bytes",
        None,
        E,
        Bytes,
        Some(Tx),
        "nic_rdma_unicast_bytes_total",
        "RDMA unicast bytes (mlx5 rx/tx_vport_rdma_unicast_bytes)",
    ),
    s(
        Kind::NpCnpSent,
        "np_cnp_sent",
        None,
        R,
        Packets,
        Some(Tx),
        "rdma_np_cnp_sent_total",
        "CNPs the notification point sent for CE-marked RoCE packets (mlx5 np_cnp_sent)",
    ),
    s(
        Kind::NpEcnMarkedRocePackets,
        "np_ecn_marked_roce_packets",
        None,
        R,
        Packets,
        Some(Rx),
        "rdma_np_ecn_marked_roce_packets_total",
        "CE-marked RoCE packets the notification point received (mlx5 np_ecn_marked_roce_packets)",
    ),
    s(
        Kind::RpCnpHandled,
        "rp_cnp_handled",
        None,
        R,
        Packets,
        Some(Rx),
        "rdma_rp_cnp_handled_total",
        "CNPs the reaction point handled (mlx5 rp_cnp_handled)",
    ),
    s(
        Kind::RpCnpIgnored,
        "rp_cnp_ignored",
        None,
        R,
        Packets,
        Some(Rx),
        "rdma_rp_cnp_ignored_total",
        "CNPs the reaction point ignored (mlx5 rp_cnp_ignored)",
    ),
    s(
        Kind::OutOfSequence,
        "out_of_sequence",
        None,
        R,
        Packets,
        Some(Rx),
        "rdma_out_of_sequence_total",
        "packets received out of PSN order, responder (mlx5 out_of_sequence)",
    ),
    s(
        Kind::PacketSeqErr,
        "packet_seq_err",
        None,
        R,
        Packets,
        Some(Rx),
        "rdma_packet_seq_err_total",
        "PSN sequence error NAKs the requester received (mlx5 packet_seq_err)",
    ),
    s(
        Kind::ImpliedNakSeqErr,
        "implied_nak_seq_err",
        None,
        R,
        Events,
        Some(Rx),
        "rdma_implied_nak_seq_err_total",
        "implied NAK sequence errors, requester (mlx5 implied_nak_seq_err)",
    ),
    s(
        Kind::LocalAckTimeoutErr,
        "local_ack_timeout_err",
        None,
        R,
        Events,
        None,
        "rdma_local_ack_timeout_err_total",
        "local ACK timer expiries, requester (mlx5 local_ack_timeout_err)",
    ),
    s(
        Kind::DuplicateRequest,
        "duplicate_request",
        None,
        R,
        Packets,
        Some(Rx),
        "rdma_duplicate_request_total",
        "duplicate requests received, responder (mlx5 duplicate_request)",
    ),
    s(
        Kind::RnrNakRetryErr,
        "rnr_nak_retry_err",
        None,
        R,
        Packets,
        Some(Rx),
        "rdma_rnr_nak_retry_err_total",
        "RNR NAKs received, retry limit not exceeded (mlx5 rnr_nak_retry_err)",
    ),
    s(
        Kind::ReqTransportRetriesExceeded,
        "req_transport_retries_exceeded",
        None,
        R,
        Events,
        None,
        "rdma_req_transport_retries_exceeded_total",
        "QPs that exhausted their transport retries: error 12 (mlx5 req_transport_retries_exceeded)",
    ),
    s(
        Kind::ReqRnrRetriesExceeded,
        "req_rnr_retries_exceeded",
        None,
        R,
        Events,
        None,
        "rdma_req_rnr_retries_exceeded_total",
        "QPs that exhausted their RNR retries (mlx5 req_rnr_retries_exceeded)",
    ),
    s(
        Kind::OutOfBuffer,
        "out_of_buffer",
        None,
        R,
        Packets,
        Some(Rx),
        "rdma_out_of_buffer_total",
        "packets dropped for lack of a receive WQE (mlx5 out_of_buffer)",
    ),
    s(
        Kind::RxIcrcEncapsulated,
        "rx_icrc_encapsulated",
        None,
        R,
        Packets,
        Some(Rx),
        "rdma_rx_icrc_encapsulated_total",
        "received RoCE packets with a bad ICRC (mlx5 rx_icrc_encapsulated)",
    ),
    Spec {
        optional: true,
        ..s(
            Kind::CcRxCePkts,
            "cc_rx_ce_pkts",
            None,
            R,
            Packets,
            Some(Rx),
            "rdma_cc_rx_ce_pkts_total",
            "CE-marked RoCE packets received (mlx5 optional cc_rx_ce_pkts)",
        )
    },
    Spec {
        optional: true,
        ..s(
            Kind::CcRxCnpPkts,
            "cc_rx_cnp_pkts",
            None,
            R,
            Packets,
            Some(Rx),
            "rdma_cc_rx_cnp_pkts_total",
            "CNPs received (mlx5 optional cc_rx_cnp_pkts)",
        )
    },
    Spec {
        optional: true,
        ..s(
            Kind::CcTxCnpPkts,
            "cc_tx_cnp_pkts",
            None,
            R,
            Packets,
            Some(Tx),
            "rdma_cc_tx_cnp_pkts_total",
            "CNPs sent (mlx5 optional cc_tx_cnp_pkts)",
        )
    },
];

impl Kind {
    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(c: u8) -> Option<Self> {
        SPECS.iter().find(|s| s.kind as u8 == c).map(|s| s.kind)
    }

    pub fn spec(self) -> &'static Spec {
        SPECS
            .iter()
            .find(|s| s.kind == self)
            .expect("every kind has a spec")
    }

    pub fn per_priority(self) -> bool {
        self.spec().suffix.is_some()
    }

    /// The PFC kinds: pause frames, pause time and transitions per priority.
    pub fn is_pause(self) -> bool {
        matches!(
            self,
            Kind::RxPause
                | Kind::TxPause
                | Kind::RxPauseDuration
                | Kind::TxPauseDuration
                | Kind::RxPauseTransition
                | Kind::TxPauseTransition
        )
    }
}

/// One canonical counter of a port: a kind and, for the per-priority kinds, a priority
/// 0–7.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CounterId {
    pub kind: Kind,
    pub prio: Option<u8>,
}

impl CounterId {
    pub const fn port(kind: Kind) -> Self {
        Self { kind, prio: None }
    }

    pub const fn prio(kind: Kind, p: u8) -> Self {
        Self { kind, prio: Some(p) }
    }

    /// The canonical (mlx5) name, parsed back. `None` for any other text, and for a
    /// per-priority name outside 0–7.
    pub fn parse(name: &str) -> Option<Self> {
        SPECS.iter().find_map(|s| match s.suffix {
            None => (name == s.prefix).then_some(Self::port(s.kind)),
            Some(suffix) => {
                let rest = name.strip_prefix(s.prefix)?.strip_suffix(suffix)?;
                let p = single_digit(rest)?;
                Some(Self::prio(s.kind, p))
            }
        })
    }

    pub fn spec(self) -> &'static Spec {
        self.kind.spec()
    }
}

/// `"0"`…`"7"` as a priority.
fn single_digit(s: &str) -> Option<u8> {
    match s.as_bytes() {
        [d @ b'0'..=b'7'] => Some(d - b'0'),
        _ => None,
    }
}

impl fmt::Display for CounterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.spec();
        match (s.suffix, self.prio) {
            (Some(suffix), Some(p)) => write!(f, "{}{p}{suffix}", s.prefix),
            _ => f.write_str(s.prefix),
        }
    }
}

/// The driver behind a port, for its names (the discriminant is its wire code).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Driver {
    /// NVIDIA/Mellanox ConnectX: `mlx5_core` (netdev), `mlx5_ib` (RDMA). Canonical names.
    Mlx5,
    /// Broadcom: `bnxt_en` (netdev), `bnxt_re` (RDMA).
    Bnxt,
    /// AMD Pensando: `ionic` (netdev and RDMA).
    Ionic,
    /// Microsoft Azure: `mana` (netdev), `mana_ib` (RDMA).
    Mana,
    /// Intel E810: `ice` (netdev), `irdma` (RDMA).
    Intel,
    /// Soft-RoCE (`rdma_rxe`): RDMA counters only, no CNP/DCQCN.
    Rxe,
    /// Anything else: only the canonical names are recognised.
    Other,
}

impl Driver {
    /// From a kernel driver name (the netdev's or the RDMA device's).
    pub fn from_kernel(name: &str) -> Self {
        match name {
            "mlx5_core" | "mlx5_ib" | "mlx5" => Driver::Mlx5,
            "bnxt_en" | "bnxt_re" => Driver::Bnxt,
            "ionic" | "ionic_rdma" => Driver::Ionic,
            "mana" | "mana_ib" => Driver::Mana,
            "ice" | "irdma" | "i40e" => Driver::Intel,
            "rdma_rxe" | "rxe" => Driver::Rxe,
            _ => Driver::Other,
        }
    }

    pub const ALL: [Driver; 7] = [
        Driver::Mlx5,
        Driver::Bnxt,
        Driver::Ionic,
        Driver::Mana,
        Driver::Intel,
        Driver::Rxe,
        Driver::Other,
    ];

    pub fn from_code(c: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|d| *d as u8 == c)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Driver::Mlx5 => "mlx5",
            Driver::Bnxt => "bnxt",
            Driver::Ionic => "ionic",
            Driver::Mana => "mana",
            Driver::Intel => "ice/irdma",
            Driver::Rxe => "rxe",
            Driver::Other => "other",
        }
    }
}

/// One driver-specific name for a canonical kind: `prefix{p}suffix` for per-priority
/// names. Sources: the kernel files named in `../shared/NIC_COUNTERS.md`.
#[derive(Clone, Copy, Debug)]
pub struct Alias {
    pub driver: Driver,
    pub source: Source,
    pub prefix: &'static str,
    pub suffix: Option<&'static str>,
    pub kind: Kind,
}

const fn a(
    driver: Driver,
    source: Source,
    prefix: &'static str,
    suffix: Option<&'static str>,
    kind: Kind,
) -> Alias {
    Alias {
        driver,
        source,
        prefix,
        suffix,
        kind,
    }
}

use Driver::{Bnxt, Intel, Ionic, Mana, Rxe};

/// Other drivers' names for the canonical kinds. mlx5 (and an unknown driver) use the
/// canonical names themselves.
pub const ALIASES: &[Alias] = &[
    // bnxt_re hw_counters (drivers/infiniband/hw/bnxt_re/hw_counters.c), the names before
    // the 2025 rename to mlx5's (which the canonical names cover, but for np_cnp_pkts).
    a(Bnxt, R, "tx_cnp_pkts", None, Kind::NpCnpSent),
    a(Bnxt, R, "np_cnp_pkts", None, Kind::NpCnpSent),
    a(Bnxt, R, "rx_cnp_pkts", None, Kind::RpCnpHandled),
    a(Bnxt, R, "rx_ecn_marked_pkts", None, Kind::NpEcnMarkedRocePackets),
    a(Bnxt, R, "seq_err_naks_rcvd", None, Kind::PacketSeqErr),
    a(Bnxt, R, "to_retransmits", None, Kind::LocalAckTimeoutErr),
    a(Bnxt, R, "missing_resp", None, Kind::ImpliedNakSeqErr),
    a(Bnxt, R, "dup_req", None, Kind::DuplicateRequest),
    a(Bnxt, R, "oos_drop_count", None, Kind::OutOfSequence),
    a(
        Bnxt,
        R,
        "max_retry_exceeded",
        None,
        Kind::ReqTransportRetriesExceeded,
    ),
    a(Bnxt, R, "rnr_naks_rcvd", None, Kind::RnrNakRetryErr),
    a(Bnxt, R, "rx_out_of_buffer", None, Kind::OutOfBuffer),
    // bnxt_en ethtool (drivers/net/ethernet/broadcom/bnxt/bnxt_ethtool.c): port and
    // port-ext statistics, when the firmware has them.
    a(Bnxt, E, "rx_pfc_ena_frames_pri", Some(""), Kind::RxPause),
    a(Bnxt, E, "tx_pfc_ena_frames_pri", Some(""), Kind::TxPause),
    a(Bnxt, E, "pfc_pri", Some("_rx_duration_us"), Kind::RxPauseDuration),
    a(Bnxt, E, "pfc_pri", Some("_tx_duration_us"), Kind::TxPauseDuration),
    a(
        Bnxt,
        E,
        "pfc_pri",
        Some("_rx_transitions"),
        Kind::RxPauseTransition,
    ),
    a(
        Bnxt,
        E,
        "pfc_pri",
        Some("_tx_transitions"),
        Kind::TxPauseTransition,
    ),
    a(Bnxt, E, "rx_packets_pri", Some(""), Kind::RxPrioPackets),
    a(Bnxt, E, "tx_packets_pri", Some(""), Kind::TxPrioPackets),
    a(Bnxt, E, "rx_bytes_pri", Some(""), Kind::RxPrioBytes),
    a(Bnxt, E, "tx_bytes_pri", Some(""), Kind::TxPrioBytes),
    a(Bnxt, E, "rx_pause_frames", None, Kind::RxPauseCtrlPhy),
    a(Bnxt, E, "tx_pause_frames", None, Kind::TxPauseCtrlPhy),
    a(Bnxt, E, "rx_stat_discard", None, Kind::RxDiscardsPhy),
    a(Bnxt, E, "tx_stat_discard", None, Kind::TxDiscardsPhy),
    // ionic: the RDMA names come from the firmware (ionic_hw_stats.c has no table); these
    // are AMD's (RCCL net_telemetry.c), not read from a device. ethtool from
    // drivers/net/ethernet/pensando/ionic/ionic_stats.c: pause time per priority, pause
    // frames only summed over the priorities.
    a(Ionic, R, "tx_rdma_cnp_pkts", None, Kind::NpCnpSent),
    a(Ionic, R, "rx_rdma_cnp_pkts", None, Kind::RpCnpHandled),
    a(Ionic, R, "rx_rdma_ecn_pkts", None, Kind::NpEcnMarkedRocePackets),
    a(Ionic, R, "tx_rdma_ack_timeout", None, Kind::LocalAckTimeoutErr),
    a(Ionic, R, "req_rx_pkt_seq_err", None, Kind::PacketSeqErr),
    a(Ionic, R, "req_rx_impl_nak_seq_err", None, Kind::ImpliedNakSeqErr),
    a(Ionic, R, "resp_rx_outouf_seq", None, Kind::OutOfSequence),
    a(Ionic, R, "resp_rx_outof_buf", None, Kind::OutOfBuffer),
    a(
        Ionic,
        R,
        "req_tx_retry_excd_err",
        None,
        Kind::ReqTransportRetriesExceeded,
    ),
    a(Ionic, E, "frames_rx_pri_", Some(""), Kind::RxPrioPackets),
    a(Ionic, E, "frames_tx_pri_", Some(""), Kind::TxPrioPackets),
    a(
        Ionic,
        E,
        "rx_pripause_",
        Some("_1us_count"),
        Kind::RxPauseDuration,
    ),
    a(
        Ionic,
        E,
        "tx_pripause_",
        Some("_1us_count"),
        Kind::TxPauseDuration,
    ),
    a(Ionic, E, "frames_rx_pripause", None, Kind::RxPauseCtrlPhy),
    a(Ionic, E, "frames_tx_pripause", None, Kind::TxPauseCtrlPhy),
    // mana_ib (drivers/infiniband/hw/mana/counters.c): port counters, and the device's
    // (sent_cnps, received_ecns: in the device's own hw_counters directory).
    a(Mana, R, "sent_cnps", None, Kind::NpCnpSent),
    a(Mana, R, "received_cnps", None, Kind::RpCnpHandled),
    a(Mana, R, "received_ecns", None, Kind::NpEcnMarkedRocePackets),
    a(Mana, R, "requester_timeout", None, Kind::LocalAckTimeoutErr),
    a(Mana, R, "requester_oos_nak", None, Kind::PacketSeqErr),
    a(Mana, R, "requester_implicit_nak", None, Kind::ImpliedNakSeqErr),
    a(Mana, R, "responder_oos", None, Kind::OutOfSequence),
    a(Mana, R, "responder_dup_request", None, Kind::DuplicateRequest),
    a(Mana, R, "requester_rnr_nak", None, Kind::RnrNakRetryErr),
    a(
        Mana,
        R,
        "requester_retries_exceeded",
        None,
        Kind::ReqTransportRetriesExceeded,
    ),
    a(
        Mana,
        R,
        "requester_rnr_nak_retries_exceeded",
        None,
        Kind::ReqRnrRetriesExceeded,
    ),
    // irdma (drivers/infiniband/hw/irdma/verbs.c; the CNP counters are 32-bit on gen2) and
    // ice ethtool (drivers/net/ethernet/intel/ice/ice_ethtool.c: pause frames, no time).
    a(Intel, R, "cnpSent", None, Kind::NpCnpSent),
    a(Intel, R, "cnpHandled", None, Kind::RpCnpHandled),
    a(Intel, R, "cnpIgnored", None, Kind::RpCnpIgnored),
    a(Intel, R, "RxECNMrkd", None, Kind::NpEcnMarkedRocePackets),
    a(Intel, E, "rx_priority_", Some("_xoff.nic"), Kind::RxPause),
    a(Intel, E, "tx_priority_", Some("_xoff.nic"), Kind::TxPause),
    a(Intel, E, "link_xoff_rx.nic", None, Kind::RxPauseCtrlPhy),
    a(Intel, E, "link_xoff_tx.nic", None, Kind::TxPauseCtrlPhy),
    // rxe hw_counters (drivers/infiniband/sw/rxe/rxe_hw_counters.c): no CNP/DCQCN.
    a(Rxe, R, "out_of_seq_request", None, Kind::OutOfSequence),
    a(Rxe, R, "rcvd_seq_err", None, Kind::PacketSeqErr),
    a(Rxe, R, "duplicate_request", None, Kind::DuplicateRequest),
    a(Rxe, R, "rcvd_rnr_err", None, Kind::RnrNakRetryErr),
    a(
        Rxe,
        R,
        "retry_exceeded_err",
        None,
        Kind::ReqTransportRetriesExceeded,
    ),
    a(
        Rxe,
        R,
        "retry_rnr_exceeded_err",
        None,
        Kind::ReqRnrRetriesExceeded,
    ),
];

/// The canonical counter a driver's counter `name` (read from `source`) is, if any. The
/// canonical names themselves are accepted from every driver (newer drivers adopt them).
pub fn alias(driver: Driver, source: Source, name: &str) -> Option<CounterId> {
    if let Some(id) = CounterId::parse(name)
        && id.spec().source == source
    {
        return Some(id);
    }
    ALIASES
        .iter()
        .filter(|a| a.driver == driver && a.source == source)
        .find_map(|a| match a.suffix {
            None => (name == a.prefix).then_some(CounterId::port(a.kind)),
            Some(suffix) => {
                let p = single_digit(name.strip_prefix(a.prefix)?.strip_suffix(suffix)?)?;
                Some(CounterId::prio(a.kind, p))
            }
        })
}

/// Whether `driver` has a name for `kind` at all (mlx5: every canonical kind; an unknown
/// driver: none known, though a canonical name it shows is still taken).
pub fn driver_names(driver: Driver, kind: Kind) -> bool {
    driver == Driver::Mlx5 || ALIASES.iter().any(|a| a.driver == driver && a.kind == kind)
}

/// Why a port has no value for a counter (the discriminant is its wire code).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[repr(u8)]
pub enum Missing {
    /// No RDMA device behind this netdev: no `hw_counters`.
    NoRdmaDevice,
    /// The RDMA port has no `hw_counters` directory (old kernel or driver).
    NoHwCounters,
    /// The netdev has no ethtool statistics.
    NoEthtoolStats,
    /// The driver has no counter for this.
    NotInDriver,
    /// A per-priority pause counter absent while other priorities have theirs: PFC is
    /// not enabled on this priority (mlx5 exposes them only where it is).
    PfcNotEnabled,
    /// No per-priority pause counter on any priority: this firmware does not expose them,
    /// or PFC is enabled on no priority.
    NoPerPriorityPause,
    /// The driver names it, this port does not show it (firmware without the
    /// capability).
    NotExposed,
    /// An optional counter: off until enabled, and read through RDMA netlink.
    Optional,
    /// The file or statistic could not be read.
    Unreadable,
    /// It was there at the previous read and is not now (driver reload, PFC turned off).
    Gone,
}

impl Missing {
    pub const ALL: [Missing; 10] = [
        Missing::NoRdmaDevice,
        Missing::NoHwCounters,
        Missing::NoEthtoolStats,
        Missing::NotInDriver,
        Missing::PfcNotEnabled,
        Missing::NoPerPriorityPause,
        Missing::NotExposed,
        Missing::Optional,
        Missing::Unreadable,
        Missing::Gone,
    ];

    pub fn from_code(c: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|m| *m as u8 == c)
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Missing::NoRdmaDevice => "no_rdma_device",
            Missing::NoHwCounters => "no_hw_counters",
            Missing::NoEthtoolStats => "no_ethtool_stats",
            Missing::NotInDriver => "not_in_driver",
            Missing::PfcNotEnabled => "pfc_not_enabled",
            Missing::NoPerPriorityPause => "no_per_priority_pause",
            Missing::NotExposed => "not_exposed",
            Missing::Optional => "optional_disabled",
            Missing::Unreadable => "unreadable",
            Missing::Gone => "gone",
        }
    }

    /// The reason in words.
    pub fn explain(self) -> &'static str {
        match self {
            Missing::NoRdmaDevice => "no RDMA device behind this interface",
            Missing::NoHwCounters => "the RDMA port has no hw_counters (kernel or driver too old)",
            Missing::NoEthtoolStats => "the interface has no ethtool statistics",
            Missing::NotInDriver => "this driver has no such counter",
            Missing::PfcNotEnabled => {
                "PFC is not enabled on this priority (the NIC counts pause only where it is)"
            }
            Missing::NoPerPriorityPause => {
                "no per-priority pause counter on any priority: firmware without them, or PFC enabled on none"
            }
            Missing::NotExposed => {
                "the driver names it but this port does not expose it (firmware capability)"
            }
            Missing::Optional => {
                "optional counter, off until `rdma statistic set link DEV/PORT optional-counters …` and read through RDMA netlink"
            }
            Missing::Unreadable => "could not be read",
            Missing::Gone => "present at the previous read, gone now (driver reload, PFC turned off)",
        }
    }
}

/// How many bits a counter has before it wraps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Width {
    Bits32,
    Bits64,
}

/// What happened to one counter between two reads of the same port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// It went up by this much.
    Delta(u64),
    /// A 32-bit counter passed its maximum: the increase across the wrap.
    Wrapped(u64),
    /// It went down (or the port's epoch changed): the counter was reset; the increase is
    /// unknown and never reported as a delta.
    Reset,
}

impl Step {
    /// The increase, when it is known.
    pub fn delta(self) -> Option<u64> {
        match self {
            Step::Delta(d) | Step::Wrapped(d) => Some(d),
            Step::Reset => None,
        }
    }
}

/// The step from `prev` to `now`. A 64-bit counter that goes down was reset. A 32-bit
/// counter that goes down from the top half of its range to below `prev` wrapped (one wrap:
/// reads are seconds apart, and a counter 2^31 below its wrap point cannot pass it twice);
/// one that goes down from the bottom half was reset.
pub fn step(prev: u64, now: u64, width: Width) -> Step {
    if now >= prev {
        return Step::Delta(now - prev);
    }
    match width {
        Width::Bits32 if prev >= 1 << 31 && prev <= u32::MAX as u64 => {
            Step::Wrapped((1u64 << 32) - prev + now)
        }
        _ => Step::Reset,
    }
}

/// What identifies one life of a port's counters: the boot and the interface instance
/// (a driver reload makes a new netdev with a new index). When it changes, every counter
/// was reset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Epoch {
    /// `/proc/sys/kernel/random/boot_id`, as 16 bytes.
    pub boot_id: [u8; 16],
    pub ifindex: u32,
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::{format, string::ToString};

    #[test]
    fn canonical_names_round_trip() {
        for s in SPECS {
            let ids: std::vec::Vec<CounterId> = match s.suffix {
                Some(_) => (0..8).map(|p| CounterId::prio(s.kind, p)).collect(),
                None => std::vec![CounterId::port(s.kind)],
            };
            for id in ids {
                assert_eq!(CounterId::parse(&id.to_string()), Some(id), "{id}");
            }
        }
        assert_eq!(CounterId::prio(Kind::RxPause, 3).to_string(), "rx_prio3_pause");
        assert_eq!(
            CounterId::prio(Kind::TxPauseDuration, 0).to_string(),
            "tx_prio0_pause_duration"
        );
        // rx_prio3_pause is not rx_prio3_pause_duration's prefix match, and no priority 8.
        assert_eq!(
            CounterId::parse("rx_prio3_pause_duration"),
            Some(CounterId::prio(Kind::RxPauseDuration, 3))
        );
        assert_eq!(CounterId::parse("rx_prio8_pause"), None);
        assert_eq!(CounterId::parse("rx_prio12_pause"), None);
        assert_eq!(CounterId::parse("rx_prio_pause"), None);
        assert_eq!(CounterId::parse("np_cnp_sent "), None);
    }

    #[test]
    fn every_kind_has_one_spec_and_metric_names_are_prometheus_names() {
        for s in SPECS {
            assert_eq!(
                SPECS.iter().filter(|t| t.kind == s.kind).count(),
                1,
                "{:?}",
                s.kind
            );
            assert!(
                s.metric
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b == b'_' || b.is_ascii_digit())
                    && s.metric.ends_with("_total"),
                "{}",
                s.metric
            );
        }
    }

    #[test]
    fn driver_names_map_onto_canonical_counters() {
        let cases = [
            (Driver::Bnxt, R, "tx_cnp_pkts", CounterId::port(Kind::NpCnpSent)),
            (Driver::Bnxt, R, "np_cnp_pkts", CounterId::port(Kind::NpCnpSent)),
            (
                Driver::Bnxt,
                R,
                "rx_cnp_pkts",
                CounterId::port(Kind::RpCnpHandled),
            ),
            (
                Driver::Bnxt,
                E,
                "rx_pfc_ena_frames_pri3",
                CounterId::prio(Kind::RxPause, 3),
            ),
            (
                Driver::Bnxt,
                E,
                "pfc_pri3_rx_duration_us",
                CounterId::prio(Kind::RxPauseDuration, 3),
            ),
            (
                Driver::Ionic,
                E,
                "rx_pripause_5_1us_count",
                CounterId::prio(Kind::RxPauseDuration, 5),
            ),
            (
                Driver::Ionic,
                R,
                "resp_rx_outouf_seq",
                CounterId::port(Kind::OutOfSequence),
            ),
            (
                Driver::Mana,
                R,
                "received_cnps",
                CounterId::port(Kind::RpCnpHandled),
            ),
            (
                Driver::Intel,
                E,
                "rx_priority_3_xoff.nic",
                CounterId::prio(Kind::RxPause, 3),
            ),
            (
                Driver::Rxe,
                R,
                "out_of_seq_request",
                CounterId::port(Kind::OutOfSequence),
            ),
            (
                Driver::Mlx5,
                E,
                "rx_prio3_pause",
                CounterId::prio(Kind::RxPause, 3),
            ),
            // A driver that adopted the canonical names.
            (
                Driver::Bnxt,
                R,
                "rp_cnp_handled",
                CounterId::port(Kind::RpCnpHandled),
            ),
        ];
        for (d, src, name, want) in cases {
            assert_eq!(alias(d, src, name), Some(want), "{d:?} {name}");
        }
        // Names from another source or another driver are not taken.
        assert_eq!(alias(Driver::Mlx5, R, "rx_prio3_pause"), None);
        assert_eq!(alias(Driver::Mlx5, R, "tx_cnp_pkts"), None);
        assert_eq!(alias(Driver::Bnxt, E, "rx_pfc_ena_frames_pri9"), None);
        assert_eq!(alias(Driver::Bnxt, E, "rx_pfc_ena_frames_pri"), None);
        // rxe has no CNPs.
        assert!(!driver_names(Driver::Rxe, Kind::NpCnpSent));
        assert!(driver_names(Driver::Rxe, Kind::OutOfSequence));
        assert!(driver_names(Driver::Mlx5, Kind::NpCnpSent));
    }

    #[test]
    fn wire_codes_round_trip() {
        for s in SPECS {
            assert_eq!(Kind::from_code(s.kind.code()), Some(s.kind));
        }
        for m in Missing::ALL {
            assert_eq!(Missing::from_code(m as u8), Some(m));
            assert_eq!(Missing::parse(m.as_str()), Some(m));
        }
        for d in Driver::ALL {
            assert_eq!(Driver::from_code(d as u8), Some(d));
        }
        assert_eq!(Kind::from_code(200), None);
    }

    #[test]
    fn steps_tell_deltas_wraps_and_resets_apart() {
        assert_eq!(step(10, 25, Width::Bits64), Step::Delta(15));
        assert_eq!(step(10, 10, Width::Bits32), Step::Delta(0));
        // A 32-bit counter near its top wraps.
        assert_eq!(step(u32::MAX as u64 - 9, 5, Width::Bits32), Step::Wrapped(15));
        // Going down from low values is a reset, never 2^32 − x.
        assert_eq!(step(1_000, 3, Width::Bits32), Step::Reset);
        // 64-bit counters never wrap in practice: down is a reset.
        assert_eq!(step(u32::MAX as u64 - 9, 5, Width::Bits64), Step::Reset);
        assert_eq!(step(5, 3, Width::Bits64).delta(), None);
        let _ = format!("{:?}", Missing::PfcNotEnabled);
    }
}
