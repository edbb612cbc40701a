use super::*;

#[test]
fn report_lines_read_back_and_anything_else_is_ignored() {
    for line in [
        Line::Started {
            cmd: 12,
            supervisor: 11,
        },
        Line::CmdError(libc::ENOENT),
        Line::HelperError(libc::EINVAL),
        Line::Fenced(libc::SIGKILL),
        Line::Exited(exit::killed_by(libc::SIGTERM)),
    ] {
        let text = line.encode();
        assert!(text.ends_with('\n') && text.len() < 64, "{text:?}");
        assert_eq!(Line::parse(text.trim_end()), Some(line));
    }
    for junk in ["", "started 12", "fenced x", "fenced 9 9", "hello 1"] {
        assert_eq!(Line::parse(junk), None, "{junk:?}");
    }
}

#[test]
fn each_signal_is_due_once_at_its_point() {
    let fence = Fence {
        term_at: Duration::from_secs(10),
        kill_at: Duration::from_secs(12),
    };
    let mut fenced = Fenced::default();
    let at = Duration::from_secs;
    let mut due = |now| fence_due(&fence, &mut fenced, now);
    assert_eq!(due(at(9)), (vec![], Some(at(10))));
    assert_eq!(due(at(10)), (vec![libc::SIGTERM], Some(at(12))));
    assert_eq!(due(at(11)), (vec![], Some(at(12))));
    assert_eq!(due(at(13)), (vec![libc::SIGKILL], None));
    assert_eq!(due(at(14)), (vec![], None));
    // A fence that is read late is carried out at once, both signals in order.
    let mut late = Fenced::default();
    assert_eq!(
        fence_due(&fence, &mut late, at(20)),
        (vec![libc::SIGTERM, libc::SIGKILL], None)
    );
}

#[test]
fn a_fence_moved_later_before_its_points_moves_the_wake() {
    let mut fenced = Fenced::default();
    let at = Duration::from_secs;
    let first = Fence {
        term_at: at(10),
        kill_at: at(12),
    };
    assert_eq!(fence_due(&first, &mut fenced, at(5)).1, Some(at(10)));
    let renewed = Fence {
        term_at: at(13),
        kill_at: at(15),
    };
    assert_eq!(
        fence_due(&renewed, &mut fenced, at(10)),
        (vec![], Some(at(13)))
    );
}
