"""LeetCode problems in DeepCoder's format whose tests need the names DeepCoder's harness provides (rllm,
rllm/rewards/code_utils/utils.py): TreeNode / ListNode, tree_node / list_node, is_same_tree / is_same_list and
its explicit imports such as a bare `xor`. Without them every reference solution below scored 0 (NameError);
with them each scores 1 and each mutated solution 0, through the real sandbox. The hostile programs check that
the helpers did not open a way around the check(candidate) guard.
"""

from __future__ import annotations

import textwrap

import pytest
from conftest import fenced

from gapo.reward import sandbox_harness as harness
from gapo.reward.code import CodeRunner

STATEMENT = ("Please solve the programming task below using a self-contained code snippet in a markdown code "
             "block.\n\n{text}\n\xa0\nPlease complete the following python code precisely:\n```python\n{stub}```")


def _problem(text: str, stub: str, solution: str, asserts: str, entry: str, mutants: dict[str, tuple[str, str]]):
    """One record as DeepCoder stores it (`tests` is the str of a dict), plus mutants: name -> (old, new)
    replacements that break the reference solution."""
    check = "def check(candidate):\n" + textwrap.indent(textwrap.dedent(asserts).strip(), "    ")
    solution = textwrap.dedent(solution)
    for old, _ in mutants.values():
        assert solution.count(old) == 1, old
    return {
        "problem": STATEMENT.format(text=text, stub=textwrap.dedent(stub)),
        "solutions": solution,
        "tests": str({"functional": f"{check}\n\n\ncheck(Solution().{entry})"}),
        "mutants": {name: solution.replace(old, new) for name, (old, new) in mutants.items()},
    }


TREE_STUB = """\
# Definition for a binary tree node.
# class TreeNode:
#     def __init__(self, val=0, left=None, right=None):
#         self.val = val
#         self.left = left
#         self.right = right
class Solution:
    def {sig}:
"""
LIST_STUB = """\
# Definition for singly-linked list.
# class ListNode:
#     def __init__(self, val=0, next=None):
#         self.val = val
#         self.next = next
class Solution:
    def {sig}:
"""

PROBLEMS = {
    "invert-binary-tree": _problem(
        "Given the root of a binary tree, invert the tree, and return its root.",
        TREE_STUB.format(sig="invertTree(self, root: Optional[TreeNode]) -> Optional[TreeNode]"),
        """\
        class Solution:
            def invertTree(self, root: Optional[TreeNode]) -> Optional[TreeNode]:
                stack = [root]
                while stack:
                    node = stack.pop()
                    if node:
                        node.left, node.right = node.right, node.left
                        stack += [node.left, node.right]
                return root
        """,
        """\
        assert is_same_tree(candidate(root = tree_node([4, 2, 7, 1, 3, 6, 9])), tree_node([4, 7, 2, 9, 6, 3, 1]))
        assert is_same_tree(candidate(root = tree_node([2, 1, 3])), tree_node([2, 3, 1]))
        assert is_same_tree(candidate(root = tree_node([1, 2, None, 3])), tree_node([1, None, 2, None, 3]))
        assert candidate(root = tree_node([])) == None
        """,
        "invertTree",
        {"only-the-root-swapped": ("stack += [node.left, node.right]", "pass"),
         "children-not-swapped": ("node.left, node.right = node.right, node.left", "pass")},
    ),
    "maximum-depth-of-binary-tree": _problem(
        "Given the root of a binary tree, return its maximum depth.",
        TREE_STUB.format(sig="maxDepth(self, root: Optional[TreeNode]) -> int"),
        """\
        class Solution:
            def maxDepth(self, root: Optional[TreeNode]) -> int:
                if root is None:
                    return 0
                return 1 + max(self.maxDepth(root.left), self.maxDepth(root.right))
        """,
        """\
        assert candidate(root = tree_node([3, 9, 20, None, None, 15, 7])) == 3
        assert candidate(root = tree_node([1, None, 2])) == 2
        assert candidate(root = tree_node([])) == 0
        assert candidate(root = tree_node([1, 2, 3, 4, None, None, 5, 6])) == 4
        """,
        "maxDepth",
        {"off-by-one": ("return 0", "return -1"),
         "left-only": ("max(self.maxDepth(root.left), self.maxDepth(root.right))", "self.maxDepth(root.left)")},
    ),
    "search-in-a-binary-search-tree": _problem(
        "You are given the root of a binary search tree (BST) and an integer val. Find the node in the BST that "
        "the node's value equals val and return the subtree rooted with that node. If such a node does not "
        "exist, return null.",
        TREE_STUB.format(sig="searchBST(self, root: Optional[TreeNode], val: int) -> Optional[TreeNode]"),
        """\
        class Solution:
            def searchBST(self, root: Optional[TreeNode], val: int) -> Optional[TreeNode]:
                while root and root.val != val:
                    root = root.left if val < root.val else root.right
                return root
        """,
        """\
        assert is_same_tree(candidate(root = tree_node([4, 2, 7, 1, 3]),val = 2), tree_node([2, 1, 3]))
        assert candidate(root = tree_node([4, 2, 7, 1, 3]),val = 5) == None
        assert is_same_tree(candidate(root = tree_node([5, 3, 6, 2, 4, None, 7]),val = 6), tree_node([6, None, 7]))
        """,
        "searchBST",
        {"swapped-children": ("root.left if val < root.val else root.right",
                              "root.right if val < root.val else root.left")},
    ),
    "binary-tree-level-order-traversal": _problem(
        "Given the root of a binary tree, return the level order traversal of its nodes' values.",
        TREE_STUB.format(sig="levelOrder(self, root: Optional[TreeNode]) -> List[List[int]]"),
        """\
        class Solution:
            def levelOrder(self, root: Optional[TreeNode]) -> List[List[int]]:
                levels, level = [], [root] if root else []
                while level:
                    levels.append([node.val for node in level])
                    level = [child for node in level for child in (node.left, node.right) if child]
                return levels
        """,
        """\
        assert candidate(root = tree_node([3, 9, 20, None, None, 15, 7])) == [[3], [9, 20], [15, 7]]
        assert candidate(root = tree_node([1])) == [[1]]
        assert candidate(root = tree_node([])) == []
        """,
        "levelOrder",
        {"swapped-children": ("(node.left, node.right)", "(node.right, node.left)")},
    ),
    "reverse-linked-list": _problem(
        "Given the head of a singly linked list, reverse the list, and return the reversed list.",
        LIST_STUB.format(sig="reverseList(self, head: Optional[ListNode]) -> Optional[ListNode]"),
        """\
        class Solution:
            def reverseList(self, head: Optional[ListNode]) -> Optional[ListNode]:
                prev = None
                while head:
                    head.next, prev, head = prev, head, head.next
                return prev
        """,
        """\
        assert is_same_list(candidate(head = list_node([1, 2, 3, 4, 5])), list_node([5, 4, 3, 2, 1]))
        assert is_same_list(candidate(head = list_node([1, 2])), list_node([2, 1]))
        assert candidate(head = list_node([])) == None
        """,
        "reverseList",
        {"wrong-link": ("while head:", "while head and head.next:")},
    ),
    "merge-two-sorted-lists": _problem(
        "You are given the heads of two sorted linked lists list1 and list2. Merge the two lists into one sorted "
        "list. Return the head of the merged linked list.",
        LIST_STUB.format(sig="mergeTwoLists(self, list1: Optional[ListNode], list2: Optional[ListNode])"
                             " -> Optional[ListNode]"),
        """\
        class Solution:
            def mergeTwoLists(self, list1: Optional[ListNode], list2: Optional[ListNode]) -> Optional[ListNode]:
                dummy = tail = ListNode()
                while list1 and list2:
                    if list1.val <= list2.val:
                        tail.next, list1 = list1, list1.next
                    else:
                        tail.next, list2 = list2, list2.next
                    tail = tail.next
                tail.next = list1 or list2
                return dummy.next
        """,
        """\
        assert is_same_list(candidate(list1 = list_node([1, 2, 4]),list2 = list_node([1, 3, 4])),
                            list_node([1, 1, 2, 3, 4, 4]))
        assert candidate(list1 = list_node([]),list2 = list_node([])) == None
        assert is_same_list(candidate(list1 = list_node([]),list2 = list_node([0])), list_node([0]))
        assert is_same_list(candidate(list1 = list_node([5]),list2 = list_node([1, 2, 8])), list_node([1, 2, 5, 8]))
        """,
        "mergeTwoLists",
        {"rest-not-linked": ("tail.next = list1 or list2", "tail.next = list1"),
         "off-by-one": ("return dummy.next", "return dummy.next.next if dummy.next else None")},
    ),
    "remove-nth-node-from-end-of-list": _problem(
        "Given the head of a linked list, remove the nth node from the end of the list and return its head.",
        LIST_STUB.format(sig="removeNthFromEnd(self, head: Optional[ListNode], n: int) -> Optional[ListNode]"),
        """\
        class Solution:
            def removeNthFromEnd(self, head: Optional[ListNode], n: int) -> Optional[ListNode]:
                dummy = ListNode(0, head)
                fast = slow = dummy
                for _ in range(n):
                    fast = fast.next
                while fast.next:
                    fast, slow = fast.next, slow.next
                slow.next = slow.next.next
                return dummy.next
        """,
        """\
        assert is_same_list(candidate(head = list_node([1, 2, 3, 4, 5]),n = 2), list_node([1, 2, 3, 5]))
        assert candidate(head = list_node([1]),n = 1) == None
        assert is_same_list(candidate(head = list_node([1, 2]),n = 1), list_node([1]))
        """,
        "removeNthFromEnd",
        {"off-by-one": ("for _ in range(n):", "for _ in range(n - 1):")},
    ),
    "find-the-original-array-of-prefix-xor": _problem(
        "You are given an integer array pref of size n. Find and return the array arr of size n that satisfies "
        "pref[i] = arr[0] ^ arr[1] ^ ... ^ arr[i].",
        "class Solution:\n    def findArray(self, pref: List[int]) -> List[int]:\n",
        """\
        class Solution:
            def findArray(self, pref: List[int]) -> List[int]:
                return [pref[0]] + [xor(a, b) for a, b in pairwise(pref)]
        """,
        """\
        assert candidate(pref = [5, 2, 0, 3, 1]) == [5, 7, 2, 3, 2]
        assert candidate(pref = [13]) == [13]
        assert list(accumulate(candidate(pref = [7, 1, 9, 12]), xor)) == [7, 1, 9, 12]
        assert reduce(or_, candidate(pref = [1, 3, 2])) == 3
        """,
        "findArray",
        {"or-for-xor": ("xor(a, b)", "or_(a, b)")},
    ),
    "all-possible-full-binary-trees": _problem(
        "Given an integer n, return a list of all possible full binary trees with n nodes. Each node of each "
        "tree in the answer must have Node.val == 0.",
        TREE_STUB.format(sig="allPossibleFBT(self, n: int) -> List[Optional[TreeNode]]"),
        """\
        class Solution:
            @cache
            def allPossibleFBT(self, n: int) -> List[Optional[TreeNode]]:
                if n == 1:
                    return [TreeNode(0)]
                return [TreeNode(0, left, right) for i in range(1, n - 1, 2)
                        for left in self.allPossibleFBT(i) for right in self.allPossibleFBT(n - 1 - i)]
        """,
        """\
        assert len(candidate(n = 7)) == 5
        assert all(is_same_tree(a, b) for a, b in zip(candidate(n = 3), [tree_node([0, 0, 0])], strict=True))
        assert all(t.val == t.left.val == t.right.val == 0 for t in candidate(n = 5))
        assert any(is_same_tree(t, tree_node([0, 0, 0, None, None, 0, 0])) for t in candidate(n = 5))
        """,
        "allPossibleFBT",
        {"swapped-children": ("TreeNode(0, left, right)", "TreeNode(0, right, None)")},
    ),
}


@pytest.fixture(scope="module")
def runner():
    # No case here expects a timeout: a limit far above any machine's time (5 s: test_deep_structures took 6-8 s
    # at load 5) keeps the verdicts the programs' own.
    with CodeRunner(num_workers=2, timeout_s=60.0) as r:
        yield r


def test_reference_solutions_pass_and_mutants_fail(runner: CodeRunner) -> None:
    items = list(PROBLEMS.values())
    results = runner.score_batch([([fenced(p["solutions"]), *map(fenced, p["mutants"].values())], p["tests"])
                                  for p in items])
    for (name, problem), row in zip(PROBLEMS.items(), results, strict=True):
        assert row[0].reward == 1.0, (name, row[0])
        for mutant, result in zip(problem["mutants"], row[1:], strict=True):
            assert result.reward == 0.0 and result.status == "wrong", (name, mutant, result)
            assert "NameError" not in result.detail, (name, mutant, result)


def test_solutions_with_their_own_node_classes_pass(runner: CodeRunner) -> None:
    """Many LeetCode answers keep the class definition uncommented; results of that class are rebuilt."""
    own = ("class TreeNode:\n    def __init__(self, val=0, left=None, right=None):\n"
           "        self.val, self.left, self.right = val, left, right\n\n"
           "class Solution:\n    def invertTree(self, root):\n        if root is None:\n            return None\n"
           "        return TreeNode(root.val, self.invertTree(root.right), self.invertTree(root.left))\n")
    [result] = runner.score([fenced(own)], PROBLEMS["invert-binary-tree"]["tests"])
    assert result.status == "correct", result


def test_deep_structures(runner: CodeRunner) -> None:
    """A 20000-deep tree and a 100000-long list: no recursion limit in building or comparing them."""
    tests = str({"functional": "def check(candidate):\n"
                               "    assert is_same_tree(candidate(root = tree_node([1] + [None, 2] * 20000)),"
                               " tree_node([1] + [2, None] * 20000))\n\ncheck(Solution().invertTree)"})
    [result] = runner.score([fenced(PROBLEMS["invert-binary-tree"]["solutions"])], tests)
    assert result.status == "correct", result
    tests = str({"functional": "def check(candidate):\n    assert is_same_list(candidate(head = list_node("
                               "list(range(100000)))), list_node(list(range(99999, -1, -1))))\n\n"
                               "check(Solution().reverseList)"})
    [result] = runner.score([fenced(PROBLEMS["reverse-linked-list"]["solutions"])], tests)
    assert result.status == "correct", result


# Right on the first test only, then the hack is meant to pass the others.
REVERSE_FIRST_ONLY = """\
class Solution:
    calls = 0

    def reverseList(self, head):
        Solution.calls += 1
        if Solution.calls > 1:
            return head
        prev = None
        while head:
            head.next, prev, head = prev, head, head.next
        {hack}
        return prev
"""


@pytest.mark.parametrize(
    "program",
    [
        # redefine the comparison, at definition time or while answering (after a right first answer)
        "is_same_list = lambda a, b: True\nclass Solution:\n    def reverseList(self, head):\n        return head\n",
        REVERSE_FIRST_ONLY.format(hack="global is_same_list\n        is_same_list = lambda *a: True"),
        # patch the harness's node class so that every tree or list reads the same
        REVERSE_FIRST_ONLY.format(hack="ListNode.val = property(lambda self: 0)\n        "
                                       "ListNode.next = property(lambda self: None)"),
        # values that compare equal to anything, in a list of the right length
        "class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n    __ne__ = lambda s, o: False\n"
        "class Solution:\n    def reverseList(self, head):\n        n = 0\n        while head:\n"
        "            n, head = n + 1, head.next\n        return list_node([AlwaysEqual()] * n)\n",
        # a right answer except a node that equals None where None is expected
        "class ListNode:\n    val, next = 0, None\n    def __eq__(self, other):\n        return True\n"
        "class Solution:\n    def reverseList(self, head):\n        if head is None:\n            return ListNode()\n"
        "        prev = None\n        while head:\n            head.next, prev, head = prev, head, head.next\n"
        "        return prev\n",
        # a cycle
        "class Solution:\n    def reverseList(self, head):\n        node = ListNode(5)\n        node.next = node\n"
        "        return node\n",
    ],
    ids=["redefine-helper", "rebind-helpers-at-run-time", "patch-node-class", "always-equal-value",
         "always-equal-node", "cyclic-list"],
)
def test_hostile_programs_cannot_fake_a_linked_answer(runner: CodeRunner, program: str) -> None:
    [result] = runner.score([fenced(program)], PROBLEMS["reverse-linked-list"]["tests"])
    assert result.status == "wrong", result


def test_tree_node_mirrors_deepcoder_semantics() -> None:
    """Level order with None holes; values past the last waiting parent are ignored; is_same_* compare shapes."""
    tree = harness.tree_node([1, 2, 3, None, 4, None, None, 99])
    assert (tree.val, tree.left.val, tree.right.val, tree.left.left, tree.left.right.val) == (1, 2, 3, None, 4)
    assert tree.left.right.left.val == 99 and tree.right.left is None
    assert harness.is_same_tree(harness.tree_node([1, None, None, 99]), harness.tree_node([1]))
    assert harness.tree_node([]) is None and harness.list_node([]) is None
    assert harness.is_same_tree(None, None) and harness.is_same_list(None, None)
    assert not harness.is_same_tree(harness.tree_node([1, 2]), harness.tree_node([1, None, 2]))
    assert not harness.is_same_list(harness.list_node([1, 2]), harness.list_node([1, 2, 3]))
    head = harness.list_node([3, 1, 2])
    assert (head.val, head.next.val, head.next.next.val, head.next.next.next) == (3, 1, 2, None)


def test_prelude_names() -> None:
    """The names DeepCoder's harness gives every program, including those our star imports do not bring."""
    namespace: dict = {}
    exec(harness.PRELUDE, namespace)
    import copy
    import operator
    import os.path
    import re

    assert namespace["xor"] is operator.xor and namespace["or_"] is operator.or_ and namespace["iand"] is operator.iand
    assert namespace["deepcopy"] is copy.deepcopy and namespace["re_search"] is re.search
    assert namespace["commonprefix"] is os.path.commonprefix and "pow" not in namespace  # no star shadows pow
    assert all(name in namespace for name in ("pairwise", "accumulate", "Optional", "inf", "atan2", "datetime"))
