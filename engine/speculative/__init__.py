"""The speculative algorithm as pure tensor functions: draft trees and their verification."""
